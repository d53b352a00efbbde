"""Tests of the named GPU profiles (`jaxserve.core.profiles`) and of their fit.

The constants in `profiles.py` must be what `jaxserve.core.profile_fit` computes from the saved
source rows, so a changed CSV or fit shows up here.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from jaxserve.core.profiles import (
    DEFAULT_MAX_BATCH,
    DEFAULT_QUEUE_CAP,
    PROFILES,
    TIERS,
    get_profile,
    profile_names,
)
from jaxserve.core.types import PROFILE_FLOAT_FIELDS, GPUProfile, stack_profiles, validate_profile
from jaxserve.core import profile_fit as fit_profiles
from jaxserve.scripts import fit_profiles as fit_cli

COEFS = ("c0", "alpha", "alpha2", "beta", "gamma", "delta")


def service_time(prof: GPUProfile, p, o) -> float:
    """T(S) of docs/contract_static.md, written out independently of the fit script."""
    p = np.asarray(p, dtype=np.float64)
    o = np.asarray(o, dtype=np.float64)
    return (prof.c0 + prof.alpha * p.sum() + prof.alpha2 * np.sum(p * p)
            + o.max() * (prof.beta + prof.gamma * p.size + prof.delta * p.sum()))


# ---------------------------------------------------------------- validity

def test_at_least_three_profiles_and_names_match_keys():
    assert len(PROFILES) >= 3
    assert profile_names() == list(PROFILES)
    for name, prof in PROFILES.items():
        assert isinstance(prof, GPUProfile)
        assert prof.name == name
        gpu, *_, tp = name.split("-")
        assert gpu in ("a100", "h100") and tp.startswith("tp") and int(tp[2:]) >= 1


@pytest.mark.parametrize("name", list(PROFILES))
def test_profile_coefficients_finite_nonnegative(name):
    prof = PROFILES[name]
    validate_profile(prof)
    for f in PROFILE_FLOAT_FIELDS:
        v = getattr(prof, f)
        assert isinstance(v, float) and math.isfinite(v) and v >= 0.0, (f, v)
    # Every profile has a non-trivial prefill and decode cost.
    assert prof.alpha > 0 and prof.beta > 0
    assert prof.max_batch == DEFAULT_MAX_BATCH == 16
    assert prof.queue_cap == DEFAULT_QUEUE_CAP == 64
    assert prof.timeout == 0.0


def test_profiles_stack_into_a_cluster():
    cluster = stack_profiles([get_profile(t) for t in ("fast", "mid", "slow")])
    assert cluster.alpha.shape == (3,)
    assert cluster.name == "+".join(TIERS[t] for t in ("fast", "mid", "slow"))


# ---------------------------------------------------------------- ordering

def test_fast_mid_slow_typical_batch():
    p, o = np.full(8, 512), np.full(8, 128)
    t = {tier: service_time(get_profile(tier), p, o) for tier in ("fast", "mid", "slow")}
    assert t["fast"] < t["mid"] < t["slow"]
    # The values quoted in profiles.py and docs/profiles.md.
    assert round(t["fast"], 2) == 4.42
    assert round(t["mid"], 2) == 7.16
    assert round(t["slow"], 2) == 9.28


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("prompt", [128, 1024, 4096])
@pytest.mark.parametrize("out", [16, 256])
def test_fast_mid_slow_over_a_grid(batch, prompt, out):
    p, o = np.full(batch, prompt), np.full(batch, out)
    fast, mid, slow = (service_time(get_profile(t), p, o) for t in ("fast", "mid", "slow"))
    assert fast < mid < slow


@pytest.mark.parametrize("model_tp", ["llama2-70b-tp2", "llama2-70b-tp4", "llama2-70b-tp8",
                                      "bloom-176b-tp8"])
def test_h100_faster_than_a100_same_replica(model_tp):
    h, a = PROFILES[f"h100-{model_tp}"], PROFILES[f"a100-{model_tp}"]
    for batch in (1, 8, 16):
        p, o = np.full(batch, 512), np.full(batch, 128)
        assert service_time(h, p, o) < service_time(a, p, o)


# ---------------------------------------------------------------- get_profile

def test_get_profile_returns_named_and_tier():
    for name in PROFILES:
        assert get_profile(name) is PROFILES[name]
    for tier, name in TIERS.items():
        assert get_profile(tier) is PROFILES[name]


def test_get_profile_overrides():
    prof = get_profile("mid", max_batch=4, timeout=0.5)
    assert prof.max_batch == 4 and prof.timeout == 0.5
    assert prof.alpha == PROFILES[TIERS["mid"]].alpha
    assert PROFILES[TIERS["mid"]].max_batch == 16  # the table is not modified


@pytest.mark.parametrize("bad", ["", "h100", "H100-LLAMA2-70B-TP4", "a100-llama2-7b", None, 3])
def test_get_profile_unknown_lists_valid_names(bad):
    with pytest.raises(ValueError) as exc:
        get_profile(bad)
    msg = str(exc.value)
    for name in list(PROFILES) + list(TIERS):
        assert name in msg


def test_get_profile_bad_overrides():
    with pytest.raises(ValueError, match="nonexistent"):
        get_profile("fast", nonexistent=1.0)
    with pytest.raises(ValueError, match="max_batch"):
        get_profile("fast", max_batch=0)
    with pytest.raises(ValueError, match="alpha"):
        get_profile("fast", alpha=-1.0)


# ---------------------------------------------------------------- fit reproducibility

@pytest.fixture(scope="module")
def fits():
    return fit_profiles.fit_all()


def test_every_profile_is_fitted(fits):
    assert set(fits) == set(PROFILES)


@pytest.mark.parametrize("name", list(PROFILES))
def test_constants_equal_fit(fits, name):
    got = fits[name].coefficients()
    prof = PROFILES[name]
    for k in COEFS:
        want = getattr(prof, k)
        if want == 0.0:
            assert got[k] == 0.0, (name, k, got[k])
        else:
            assert got[k] == pytest.approx(want, rel=1e-6), (name, k)


@pytest.mark.parametrize("name", list(PROFILES))
def test_fit_quality(fits, name):
    f = fits[name]
    assert f.prefill.n_rows == f.decode.n_rows == 60
    assert f.prefill.r2 > 0.96
    assert f.decode.r2 > 0.85
    assert f.decode.max_rel_err < 0.08
    assert f.service_max_rel_err < 0.08


def test_nnls_matches_unconstrained_when_feasible_and_clips_otherwise():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(50), rng.uniform(0, 10, 50), rng.uniform(0, 100, 50)])
    c_true = np.array([0.5, 2.0, 0.03])
    y = x @ c_true
    assert np.allclose(fit_profiles.nnls(x, y), c_true)
    y2 = x @ np.array([0.5, -2.0, 0.3])  # best unconstrained fit has a negative slope
    c = fit_profiles.nnls(x, y2)
    assert np.all(c >= 0)
    ls, *_ = np.linalg.lstsq(x, y2, rcond=None)
    assert np.sum((x @ c - y2) ** 2) >= np.sum((x @ ls - y2) ** 2) - 1e-9


def test_script_service_time_matches_model():
    prof = PROFILES["a100-bloom-176b-tp8"]
    coef = {k: getattr(prof, k) for k in COEFS}
    p, o = np.array([100, 2000, 7]), np.array([5, 300, 1])
    assert fit_profiles.service_time(coef, p, o) == pytest.approx(service_time(prof, p, o))


def test_script_prints_table_and_entries(capsys):
    fit_cli.main(["--python"])
    out = capsys.readouterr().out
    assert "378088013a54df6f2052c27ff5ae6ea7619c3ecc" in out
    for name in PROFILES:
        assert f'"{name}": _profile(' in out


# ---------------------------------------------------------------- provenance of the data

def test_source_csv_small_with_provenance():
    path = Path(fit_profiles.DATA_CSV)
    assert path.is_file() and path.stat().st_size < 50_000
    header = "".join(ln for ln in path.read_text().splitlines(keepends=True)
                     if ln.startswith("#"))
    for needle in ("Mutinifni/splitwise-sim", "data/perf_model.csv",
                   "378088013a54df6f2052c27ff5ae6ea7619c3ecc", "MIT"):
        assert needle in header
    rows = fit_profiles.load_rows(path)
    assert rows["prompt_time"].size == 65 * len(fit_profiles.CONFIGS)
    assert np.all(rows["prompt_time"] > 0) and np.all(rows["token_time"] > 0)
    assert np.all(rows["token_size"] == 128)


# ---------------------------------------------------------------- one closed form

def test_service_time_is_one_closed_form_for_numpy_and_jax():
    """`core.service.service_time` in float64 numpy equals the engine's float32 form, and
    `full_batch_rate` at mean sizes is `B / T(full batch)` (the nominal capacity)."""
    import jax.numpy as jnp

    from jaxserve.core.service import (batch_service_time, full_batch_rate, host_profile,
                                       service_time as closed_form)

    gpus = [get_profile(t) for t in ("fast", "mid", "slow")]
    hp = host_profile(gpus)
    p, o = np.array([100.0, 2000.0, 7.0]), np.array([5.0, 300.0, 1.0])
    host = closed_form(hp, 3, p.sum(), (p * p).sum(), o.max())
    assert host.dtype == np.float64 and host.shape == (3,)
    dev = batch_service_time(stack_profiles(gpus), 3, jnp.float32(p.sum()),
                             jnp.float32((p * p).sum()), jnp.float32(o.max()))
    np.testing.assert_allclose(np.asarray(dev), host, rtol=1e-6)
    for g, prof in enumerate(gpus):
        assert host[g] == pytest.approx(service_time(prof, p, o), rel=1e-12)
    b = np.asarray(hp.max_batch).astype(int)
    rate = full_batch_rate(gpus, 512.0, 128.0)
    want = [b[g] / service_time(gpus[g], np.full(int(b[g]), 512.0), np.full(int(b[g]), 128.0))
            for g in range(3)]
    np.testing.assert_allclose(rate, want, rtol=1e-12)
    # Sampled batches: each GPU takes the first max_batch requests of a row.
    rng = np.random.default_rng(0)
    ps, os_ = rng.integers(1, 900, (4, int(b.max()))), rng.integers(1, 200, (4, int(b.max())))
    sampled = full_batch_rate(gpus, ps, os_)
    for g in range(3):
        t = np.mean([service_time(gpus[g], ps[s, :b[g]], os_[s, :b[g]]) for s in range(4)])
        assert sampled[g] == pytest.approx(b[g] / t, rel=1e-12)
    with pytest.raises(ValueError):
        full_batch_rate(gpus, ps[:, :1], os_[:, :1])
