"""Tests of jaxserve.traces.{shaping, fitting, synthetic}: load rescaling, windows, batched
window replay, MMPP / token fits and the synthetic BurstGPT-shaped generator.

Real trace files are found with `jaxserve.traces.find` (under JAXSERVE_TRACES_DIR, which
tests/conftest.py points at `../shared/traces` beside the repository when it exists, else in the
user cache); tests that need them are skipped when they are absent.

Statistical tolerances are chosen from the sampling error of each statistic (stated at each
test) so that a fixed seed passes with several standard errors to spare.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.core import arrivals as A
from jaxserve.core.types import GPUProfile, Trace
from jaxserve.core.sources import trace_arrays
from jaxserve.envs.routing import routing_gpus
from jaxserve.evaluation.replay import replay_windows
from jaxserve.reference.sim import simulate
from jaxserve.traces import find as find_trace
from jaxserve.traces import (
    burstgpt_like,
    burstgpt_profile,
    burstgpt_stats,
    cluster_capacity,
    count_iod,
    fit_mmpp,
    fit_report,
    fit_tokens,
    fit_workload,
    load,
    mmpp_gap_moments,
    mmpp_iod,
    mmpp_stats,
    offered_load,
    published_stats,
    rescale_to_load,
    sample_arrivals_jax,
    sample_mmpp,
    sample_tokens_np,
    sample_workload,
    summary,
    window_trace,
    windows,
)


HOW = "set JAXSERVE_TRACES_DIR or run `jaxserve-traces fetch --all`"
CODE = find_trace("azure_llm_2023_code")
CONV = find_trace("azure_llm_2023_conv")
BURST_AGG = find_trace("burstgpt_aggregates")
BURST_ROWS = find_trace("burstgpt_first30")

needs_azure = pytest.mark.skipif(CODE is None or CONV is None,
                                 reason=f"Azure LLM 2023 traces not available ({HOW})")
needs_burst = pytest.mark.skipif(BURST_AGG is None,
                                 reason=f"BurstGPT aggregates not available ({HOW})")


def _trace(arr, prompt=None, output=None):
    arr = np.asarray(arr, np.float64)
    n = arr.shape[0]
    p = np.arange(1, n + 1) if prompt is None else prompt
    o = (np.arange(n) % 7 + 1) if output is None else output
    return Trace(arrival_s=arr, prompt_tokens=np.asarray(p, np.int64),
                 output_tokens=np.asarray(o, np.int64))


@pytest.fixture(scope="module")
def conv():
    if CONV is None:
        pytest.skip(f"azure_llm_2023_conv not available ({HOW})")
    return load(CONV)


@pytest.fixture(scope="module")
def code():
    if CODE is None:
        pytest.skip(f"azure_llm_2023_code not available ({HOW})")
    return load(CODE)


# ------------------------------------------------------------------------------------------
# Offered load and rescaling.
# ------------------------------------------------------------------------------------------

def test_capacity_is_the_full_batch_closed_form():
    g = GPUProfile(c0=0.02, alpha=5e-5, alpha2=1e-9, beta=0.012, gamma=2e-4, delta=1e-7,
                   max_batch=8)
    p, o, b = 700.0, 90.0, 8
    t = 0.02 + 5e-5 * b * p + 1e-9 * b * p * p + o * (0.012 + 2e-4 * b + 1e-7 * b * p)
    np.testing.assert_allclose(cluster_capacity([g], p, o), [b / t], rtol=1e-12)
    # list and stacked forms agree
    gpus = routing_gpus()
    np.testing.assert_allclose(cluster_capacity(gpus, p, o),
                               cluster_capacity(jaxserve.stack_profiles(gpus), p, o), rtol=1e-6)
    tr = _trace([0.0, 1.0, 3.0, 4.0], prompt=[700] * 4, output=[90] * 4)
    rho = offered_load(tr, [g, g])
    assert rho == pytest.approx((3 / 4.0) / (2 * b / t), rel=1e-12)


@needs_azure
@pytest.mark.parametrize("target", [0.3, 0.7, 0.95])
def test_rescale_hits_target_load_within_1pct(conv, target):
    gpus = routing_gpus()
    out, f = rescale_to_load(conv, gpus, target)
    # measured in the same definition as the target (module docstring of shaping.py)
    assert offered_load(out, gpus) == pytest.approx(target, rel=0.01)
    assert offered_load(out, gpus) == pytest.approx(target, rel=1e-9)  # in fact exact
    assert f == pytest.approx(offered_load(conv, gpus) / target, rel=1e-12)
    # only time is rescaled: gaps scale by f, tokens and burst shape (gap CV) unchanged
    np.testing.assert_allclose(np.diff(out.arrival_s), f * np.diff(conv.arrival_s), rtol=1e-9,
                               atol=1e-9)
    np.testing.assert_array_equal(out.prompt_tokens, conv.prompt_tokens)
    np.testing.assert_array_equal(out.output_tokens, conv.output_tokens)
    s0, s1 = summary(conv), summary(out)
    assert s1["cv_interarrival"] == pytest.approx(s0["cv_interarrival"], rel=1e-9)
    assert s1["mean_rate"] == pytest.approx(s0["mean_rate"] / f, rel=1e-9)


def test_rescale_errors():
    tr = _trace([0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="target_utilisation"):
        rescale_to_load(tr, routing_gpus(), 0.0)
    with pytest.raises(ValueError, match="zero time"):
        offered_load(_trace([1.0, 1.0]), routing_gpus())
    with pytest.raises(ValueError, match="at least one GPUProfile"):
        offered_load(tr, [])


# ------------------------------------------------------------------------------------------
# Windows.
# ------------------------------------------------------------------------------------------

def _check_tiling(tr, wins, first, start):
    """Concatenating the windows' valid rows reproduces the trace exactly."""
    full = trace_arrays(tr)
    length = np.asarray(wins.length)
    rows = [np.arange(int(k)) for k in length]
    cat = {f: np.concatenate([np.asarray(getattr(wins, f))[w, r] for w, r in enumerate(rows)])
           for f in ("gap", "prompt", "output")}
    n = len(tr)
    assert length.sum() == n
    np.testing.assert_array_equal(cat["prompt"], np.asarray(full.prompt))
    np.testing.assert_array_equal(cat["output"], np.asarray(full.output))
    heads = np.cumsum(np.concatenate([[0], length[:-1]]))
    np.testing.assert_array_equal(heads, first)
    g = np.asarray(full.gap).copy()
    assert np.all(cat["gap"][heads] == 0.0)  # each window rebased
    g[heads] = 0.0
    np.testing.assert_array_equal(cat["gap"], g)  # every other gap bit-identical
    np.testing.assert_array_equal(start, tr.arrival_s[first])  # window origins, float64
    # padding rows are inert
    pad = np.arange(wins.gap.shape[1])[None, :] >= length[:, None]
    assert np.all(np.asarray(wins.gap)[pad] == 0) and np.all(np.asarray(wins.prompt)[pad] == 1)


@needs_azure
@pytest.mark.parametrize("window_len", [1, 37, 1000])
def test_windows_by_requests_cover_trace_exactly_once(conv, window_len):
    wins, first, start = windows(conv, window_len, return_starts=True)
    n = len(conv)
    assert wins.gap.shape == (math.ceil(n / window_len), window_len)
    assert np.all(np.asarray(wins.length)[:-1] == window_len)
    assert int(wins.length[-1]) == n - window_len * (wins.gap.shape[0] - 1)
    _check_tiling(conv, wins, first, start)
    # a window rebuilt from its float32 gaps is the trace's rows to float32 precision
    w = wins.gap.shape[0] // 2
    sub = window_trace(wins, w, start[w])
    rows = slice(first[w], first[w] + int(wins.length[w]))
    np.testing.assert_allclose(sub.arrival_s, conv.arrival_s[rows], rtol=0, atol=1e-3)
    np.testing.assert_array_equal(sub.prompt_tokens, conv.prompt_tokens[rows])


@needs_azure
def test_windows_by_time_cover_trace_exactly_once(code):
    wins, first, start = windows(code, 60.0, by="time", return_starts=True)
    _check_tiling(code, wins, first, start)
    t = code.arrival_s - code.arrival_s[0]
    k = np.floor(t[first] / 60.0)
    length = np.asarray(wins.length)
    for w in range(0, len(first), 7):
        seg = t[first[w]:first[w] + length[w]]
        assert np.all(seg >= k[w] * 60.0)
        assert np.all((seg < (k[w] + 1) * 60.0) | (seg == t[-1]))
    # the code trace has silent minutes; they are left out, not emitted as empty windows
    assert np.all(length > 0) and len(first) < math.ceil(t[-1] / 60.0)
    assert wins.gap.shape[1] == length.max()


def test_windows_stride_and_errors():
    tr = _trace(np.arange(10) * 0.5)
    wins, first, _ = windows(tr, 4, stride=2, return_starts=True)
    assert first.tolist() == [0, 2, 4, 6]  # the window at 6 reaches the end; no more
    assert np.asarray(wins.length).tolist() == [4, 4, 4, 4]
    wins, first, _ = windows(tr, 2, stride=4, return_starts=True)
    assert first.tolist() == [0, 4, 8] and np.asarray(wins.length).tolist() == [2, 2, 2]
    assert windows(tr, 4, pad_to=6).gap.shape == (3, 6)
    with pytest.raises(ValueError, match="window_len"):
        windows(tr, 0)
    with pytest.raises(ValueError, match="pad_to"):
        windows(tr, 4, pad_to=3)
    with pytest.raises(ValueError, match="by must be"):
        windows(tr, 4, by="tokens")


# ------------------------------------------------------------------------------------------
# Thousands of windows in parallel, one compiled program.
# ------------------------------------------------------------------------------------------

def jsq(key, obs, state, params):
    """Join the shortest queue (waiting + running; ties to the lowest index)."""
    c = state.cluster
    return jnp.argmin(c.queues.count + c.servers.run_count).astype(jnp.int32)


def test_replay_windows_vmaps_thousands_of_episodes():
    """2,421 windows of 8 requests of the conv trace (rescaled to offered load 0.8; without
    the data file, a synthetic trace of the same size) run as 2,421 episodes of Routing-v0
    under JSQ in one jitted vmap; each is checked for conservation, and 25 of them (with the
    padded last one) against the event-by-event reference simulator fed the actions the
    policy took."""
    env, params = jaxserve.make("Routing-v0")
    gpus = routing_gpus()
    if CONV.is_file():
        base = load(CONV)
    else:
        base = sample_workload(0, A.mmpp([6.5, 3.3], [0.0075, 0.017]),
                               A.lognormal_tokens(800, 1.0, 120, 0.9, 8000, 1000), 19_366)
    tr, _ = rescale_to_load(base, gpus, 0.8)
    wins, first, start = windows(tr, 8, return_starts=True)
    num = wins.gap.shape[0]
    assert num > 2000
    out = replay_windows(env, params, wins, jsq, key=jax.random.PRNGKey(3))
    length = np.asarray(wins.length)
    assert out["return"].shape == (num,)
    assert np.all(np.asarray(out["terminated"]))
    np.testing.assert_array_equal(np.asarray(out["steps"]), length)
    np.testing.assert_array_equal(np.asarray(out["arrived"]), length)
    np.testing.assert_array_equal(np.asarray(out["completed"]) + np.asarray(out["dropped"]),
                                  length)  # every episode drains
    acts = np.asarray(out["actions"])
    assert acts.shape == (num, 8)
    assert np.all((acts >= 0) == (np.arange(8)[None, :] < length[:, None]))
    # a drained episode's time-in-system is its requests' total latency
    np.testing.assert_allclose(np.asarray(out["in_system_time"]),
                               np.asarray(out["latency_sum"]), rtol=1e-4)
    check = list(range(0, num, num // 24))[:24] + [num - 1]
    for w in check:
        n = int(length[w])
        sub = window_trace(wins, w)
        ref = simulate(sub.arrival_s, sub.prompt_tokens, sub.output_tokens, acts[w, :n], gpus)
        ok = ~ref["dropped"]
        assert int(out["dropped"][w]) == int(ref["dropped"].sum())
        lat = float((ref["finish"][ok] - sub.arrival_s[ok]).sum())
        assert float(out["latency_sum"][w]) == pytest.approx(lat, rel=1e-4, abs=1e-4)
        span = float(np.nanmax(ref["finish"]) - sub.arrival_s[0])
        assert float(out["makespan"][w]) == pytest.approx(span, rel=1e-4, abs=1e-4)
    # episode boundaries are windows: the same windows replayed again give the same totals
    again = replay_windows(env, params, wins, jsq, key=jax.random.PRNGKey(3))
    np.testing.assert_array_equal(np.asarray(again["return"]), np.asarray(out["return"]))


# ------------------------------------------------------------------------------------------
# MMPP statistics, samplers and fits.
# ------------------------------------------------------------------------------------------

TWO = A.mmpp([8.0, 0.5], [0.2, 0.3])  # pi = (0.6, 0.4), mean 5.0 req/s, s = 0.5/s


def test_mmpp_analytic_statistics():
    pi1, pi2, m, s, d = 0.6, 0.4, 5.0, 0.5, 7.5
    amp = 2 * pi1 * pi2 * d * d / (m * s)
    for t in (0.1, 1.0, 60.0, 1e4):
        f = 1 - (1 - math.exp(-s * t)) / (s * t)
        assert mmpp_iod(TWO, t) == pytest.approx(1 + amp * f, rel=1e-6)
    m1, m2 = mmpp_gap_moments(TWO, (1, 2))
    assert m1 == pytest.approx(1 / m, rel=1e-6)  # mean gap is 1 / mean rate
    st = mmpp_stats(A.poisson(3.0))
    assert st == pytest.approx({"mean_rate": 3.0, "cv_interarrival": 1.0, "iod_1s": 1.0,
                                "iod_60s": 1.0})


def test_numpy_sampler_matches_engine_sampler():
    """`sample_mmpp` (numpy) and `sample_arrivals_jax` (core.arrivals.sample_gap under scan)
    against each other and the analytic law. n = 50,000: the rate's relative standard error
    is sqrt(IDC(inf) / n) = sqrt(11.8 / 5e4) = 1.5 %, so 7.5 % is 5 standard errors; the
    gap CV's standard error (measured over seeds) is about 1.5 %, 10 % is > 6."""
    n = 50_000
    ref = mmpp_stats(TWO, (1.0,))
    for arr in (sample_mmpp(1, TWO, n), sample_arrivals_jax(jax.random.PRNGKey(1), TWO, n)):
        s = summary(_trace(arr), windows_s=(1.0,))
        assert arr.shape == (n,) and arr[0] == 0.0 and np.all(np.diff(arr) >= 0)
        assert s["mean_rate"] == pytest.approx(ref["mean_rate"], rel=0.075)
        assert s["cv_interarrival"] == pytest.approx(ref["cv_interarrival"], rel=0.10)
        assert count_iod(_trace(arr), 1.0)[0] == pytest.approx(ref["iod_1s"], rel=0.10)
    # token sampler: same law as core.arrivals.sample_tokens (rounded, clipped lognormal)
    dist = A.lognormal_tokens(300, 0.8, 40, 1.2, max_prompt=2000, max_output=500)
    p, o = sample_tokens_np(0, dist, 40_000)
    keys = jax.random.split(jax.random.PRNGKey(0), 40_000)
    pj, oj = jax.jit(jax.vmap(A.sample_tokens, in_axes=(0, None)))(keys, dist)
    for a, b in ((p, np.asarray(pj)), (o, np.asarray(oj))):
        assert a.min() >= 1 and b.min() >= 1 and a.max() == b.max()
        # Lengths are rounded to whole tokens, so a quantile near a half-token may land on
        # either neighbour: allow one token on top of 4%.
        np.testing.assert_allclose(np.percentile(a, [10, 50, 90]), np.percentile(b, [10, 50, 90]),
                                   rtol=0.04, atol=1.0)


def test_fit_recovers_a_known_mmpp():
    arr = sample_mmpp(7, TWO, 1_000_000)
    fit = fit_mmpp(_trace(arr, prompt=np.ones(arr.shape[0]), output=np.ones(arr.shape[0])))
    assert fit.exact and not fit.notes
    p = fit.params
    assert p["l1"] == pytest.approx(8.0, rel=0.03) and p["l2"] == pytest.approx(0.5, rel=0.1)
    assert p["r12"] == pytest.approx(0.2, rel=0.15) and p["r21"] == pytest.approx(0.3, rel=0.15)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_of_poisson_arrivals_is_poisson(seed):
    arr = sample_mmpp(seed, A.poisson(3.0), 20_000)
    fit = fit_mmpp(_trace(arr, prompt=np.ones(arr.shape[0]), output=np.ones(arr.shape[0])))
    assert fit.arrivals.num_phases == 1 and "Poisson" in fit.notes[0] and not fit.exact
    assert fit.model["mean_rate"] == pytest.approx(3.0, rel=0.03)


def test_count_iod_uses_complete_windows_only():
    # 3 complete windows with counts 2, 2, 2 and a partial fourth with 1 arrival
    tr = _trace([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.2])
    assert count_iod(tr, 1.0) == (0.0, 3)
    assert summary(tr, windows_s=(1.0,))["iod_1s"] > 0  # summary counts the partial window
    assert math.isnan(count_iod(tr, 10.0)[0])


@needs_azure
@pytest.mark.parametrize("name", ["conv", "code"])
def test_fitted_mmpp_reproduces_rate_and_cv(name, conv, code):
    """The fitted MMPP reproduces the trace's mean rate within 5 % and gap CV within 15 %.

    The fit matches rate, CV and the 1 s / 60 s IoDs exactly (analytic moments, rel. 1e-6).
    Samples drawn from it carry sampling error: the relative standard error of a sample's
    mean rate is sqrt(IDC(inf) / n), IDC(inf) being the long-run index of dispersion of the
    fitted model, 186 (code) and 33 (conv). At the traces' own sizes (8,819 and 19,366) that
    is 14.5 % and 4.1 %, so a same-size sample cannot check 5 %; we draw n = 2,000,000, where
    it is 0.97 % and 0.41 % (5 % is > 5 standard errors; measured over 40 seeds at n = 2e5:
    2.8 % and 1.4 %, as predicted). The sample gap CV's standard error, measured the same way,
    is 1.4 % (code) and 0.5 % (conv) at 2e5, so 0.44 % and 0.15 % at 2e6: 15 % is far outside
    the noise (the tolerance required of the fit's samples; the fit itself is exact).
    """
    tr = conv if name == "conv" else code
    fit = fit_mmpp(tr)
    assert fit.exact, fit.notes
    for k, v in fit.targets.items():
        assert fit.model[k] == pytest.approx(v, rel=1e-6), k
    assert mmpp_iod(fit.arrivals, 1e7) == pytest.approx({"conv": 33, "code": 186}[name], rel=0.05)
    n = 2_000_000
    arr = sample_mmpp(11, fit.arrivals, n)
    s = summary(_trace(arr, prompt=np.ones(n), output=np.ones(n)), windows_s=(60.0,))
    st = summary(tr)
    assert s["mean_rate"] == pytest.approx(st["mean_rate"], rel=0.05)
    assert s["cv_interarrival"] == pytest.approx(st["cv_interarrival"], rel=0.15)


@needs_azure
def test_token_fits_and_report(conv):
    emp = fit_tokens(conv, "empirical")
    assert emp.table_prompt.shape == (len(conv),)
    logn = fit_tokens(conv, "lognormal")
    lp = np.log(conv.prompt_tokens)
    assert float(logn.prompt_median[0]) == pytest.approx(math.exp(lp.mean()), rel=1e-5)
    assert float(logn.prompt_sigma[0]) == pytest.approx(lp.std(), rel=1e-5)
    assert float(logn.max_output) == conv.output_tokens.max()
    rep = fit_report(conv, fit_mmpp(conv).arrivals, emp, seed=0, n_samples=50_000, reps=2)
    # empirical tokens: percentiles within sampling error (n = 1e5 draws)
    for k in ("prompt_p50", "prompt_p90", "output_p50", "output_p90", "output_mean"):
        assert abs(rep[k]["rel_err"]) < 0.03, (k, rep[k])
    assert rep["mean_rate"]["model"] == pytest.approx(rep["mean_rate"]["trace"], rel=1e-6)
    with pytest.raises(ValueError, match="kind"):
        fit_tokens(conv, "gamma")


@needs_azure
def test_fit_workload_plugs_into_make(code):
    fit = fit_workload(code, n_samples=20_000, reps=1)
    env, params = jaxserve.make("Routing-v0", arrivals=fit.arrivals, tokens=fit.tokens)
    assert float(A.mean_rate(params.arrivals)) == pytest.approx(summary(code)["mean_rate"],
                                                                rel=1e-5)
    assert set(fit.report) >= {"mean_rate", "cv_interarrival", "iod_1s", "iod_60s",
                               "prompt_p99", "output_p99"}


# ------------------------------------------------------------------------------------------
# Synthetic BurstGPT-shaped traces.
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def burst_profile():
    if BURST_AGG is None or BURST_ROWS is None:
        pytest.skip(f"BurstGPT files not available ({HOW})")
    return burstgpt_profile()


@needs_burst
def test_burstgpt_like_matches_hour_of_day_and_growth(burst_profile):
    """28 days at the published volume (about 3.5e5 requests): each hour-of-day bin holds
    about 1.5e4 requests; with the burst modulation (IDC over an hour about 1 + 2 Var(Z)
    lambda / s = 1 + 2 * 0.67 * 0.07 * 60 = 6.6) the bin's relative error is
    sqrt(6.6 / 1.5e4) = 2 %, far inside 10 %. The daily trend's slope, 0.021/day, has a
    standard error of about 0.003/day over 28 days of this noise."""
    pub = published_stats(burst_profile)
    assert pub["hour_peak_to_mean"] == pytest.approx(1.839, abs=5e-4)
    assert pub["daily_log_slope"] > 0
    tr = burstgpt_like(0, days=28, profile=burst_profile)
    s = burstgpt_stats(tr)
    assert s["hour_peak_to_mean"] == pytest.approx(pub["hour_peak_to_mean"], rel=0.10)
    np.testing.assert_allclose(s["hourly"] / s["hourly"].mean(),
                               pub["hourly"] / pub["hourly"].mean(), rtol=0.1, atol=0.02)
    assert s["valley_hour"] in (6, 7, 8)
    assert s["daily_log_slope"] > 0
    assert s["daily_log_slope"] == pytest.approx(pub["daily_log_slope"], abs=0.012)
    assert tr.prompt_tokens.min() >= 1 and set(tr.prompt_tokens) <= set(burst_profile.prompt)


@needs_burst
def test_burstgpt_like_volume_days_and_bursts(burst_profile, tmp_path):
    full = burstgpt_like(1, days=61, profile=burst_profile)
    # 61 days at rate_scale 1: the published 1,429,737 requests (sd about 0.4 %)
    assert len(full) == pytest.approx(1_429_737, rel=0.03)
    half = burstgpt_like(1, days=61, rate_scale=0.5, profile=burst_profile, burst=None)
    assert len(half) == pytest.approx(1_429_737 / 2, rel=0.03)
    # observed day profile: the published daily counts (sd of a day's count about 4 % at 3e3)
    obs = burstgpt_like(2, days=14, day_profile="observed", profile=burst_profile)
    s = burstgpt_stats(obs)
    rel = s["daily"] / burst_profile.daily[:14] - 1
    assert np.median(np.abs(rel)) < 0.05 and np.abs(rel).max() < 0.2
    # calibrated bursts: week-1 per-minute token throughput CV and idle minutes near the
    # published 1.32 and 38 % (without bursts: CV ~1.0, ~25 %)
    week = burstgpt_stats(burstgpt_like(3, days=7, day_profile="observed",
                                        profile=burst_profile))
    assert week["minute_tps_cv"] == pytest.approx(1.318, rel=0.15)
    assert week["minute_zero_frac"] == pytest.approx(0.383, abs=0.05)
    flat = burstgpt_like(3, days=7, day_profile="observed", profile=burst_profile, burst=None)
    assert burstgpt_stats(flat)["minute_zero_frac"] < week["minute_zero_frac"] - 0.05
    # determinism, rebasing, jax keys
    a = burstgpt_like(5, days=0.5, profile=burst_profile, rebase=True)
    b = burstgpt_like(5, days=0.5, profile=burst_profile, rebase=True)
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
    assert a.arrival_s[0] == 0.0
    burstgpt_like(jax.random.PRNGKey(0), days=0.1, profile=burst_profile)
    with pytest.raises(ValueError, match="day_profile"):
        burstgpt_like(0, days=1, day_profile="weekly", profile=burst_profile)
    with pytest.raises(FileNotFoundError, match="BurstGPT data file not found"):
        burstgpt_profile(tmp_path / "nowhere")


def test_replay_windows_argument_errors():
    env, params = jaxserve.make("Routing-v0")
    wins = windows(_trace(np.arange(10) * 0.5), 4)
    with pytest.raises(ValueError, match="at least 4 steps"):
        replay_windows(env, params, wins, np.zeros((3, 2), np.int32))
    with pytest.raises(ValueError, match=r"shape \(W, steps\)"):
        replay_windows(env, params, wins, np.zeros((2, 4), np.int32))
    one = jax.tree.map(lambda x: x[0], wins)
    with pytest.raises(ValueError, match="leading window axis"):
        replay_windows(env, params, one, jsq)
