"""`jaxserve.core.stats`: Student-t intervals, flat and along an axis."""

import numpy as np
import pytest
from scipy.stats import t as student_t

from jaxserve.core import stats


def test_t_halfwidth_known_value_and_small_samples():
    v = [1.0, 2.0, 3.0, 4.0, np.nan]  # the NaN is left out: n = 4
    want = student_t.ppf(0.975, 3) * np.std([1, 2, 3, 4], ddof=1) / 2.0
    assert stats.t_halfwidth(v) == pytest.approx(want)
    assert np.isnan(stats.t_halfwidth([3.0]))
    # A 90% interval is narrower than the 95% one.
    assert stats.t_halfwidth(v, 0.90) < stats.t_halfwidth(v)


def test_t_halfwidth_along_axis_equals_row_by_row():
    x = np.random.default_rng(0).normal(size=(3, 5, 7))
    got = stats.t_halfwidth(x, axis=1)
    assert got.shape == (3, 7)
    for i in range(3):
        for j in range(7):
            assert got[i, j] == pytest.approx(stats.t_halfwidth(x[i, :, j]))
    assert np.all(np.isnan(stats.t_halfwidth(x[:, :1], axis=1)))


def test_percentiles_exact_over_finite_values():
    v = [4.0, 1.0, np.nan, 3.0, 2.0, np.inf]  # NaN and inf left out: 1, 2, 3, 4
    np.testing.assert_array_equal(stats.percentiles(v, [0, 50, 100]), [1.0, 2.5, 4.0])
    assert stats.percentiles(v, [99])[0] == pytest.approx(1.0 + 0.99 * 3.0)
    assert np.isnan(stats.percentiles([np.nan], [50, 99])).all()


def test_percentiles_jax_equal_the_host_definition_under_jit_and_vmap():
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    x = rng.lognormal(0.0, 1.0, (3, 50)).astype(np.float32)
    x[0, ::7] = np.nan
    x[1, 10:] = np.inf  # a traced number of valid entries: 10 in row 1
    x[2, :] = np.nan    # none: NaN, as on the host
    qs = (0.0, 50.0, 99.0, 100.0)
    got = np.asarray(jax.jit(jax.vmap(lambda v: stats.percentiles_jax(v, qs)))(jnp.asarray(x)))
    for row, g in zip(x, got):
        # float32 in JAX vs float64 on the host: equal to float32 rounding.
        np.testing.assert_allclose(g, stats.percentiles(row, qs), rtol=1e-6)
    assert np.isnan(got[2]).all()


def test_percentile_with_drops_counts_a_drop_as_infinitely_late():
    served = np.arange(1.0, 101.0)  # 1..100: p99 = 99.01
    assert stats.percentile_with_drops(served, 99) == pytest.approx(99.01)
    with_drops = np.concatenate([served[:98], [np.nan, np.nan]])
    assert stats.percentile_with_drops(with_drops, 99) == np.inf  # never NaN
    assert stats.percentile_with_drops(with_drops, 50) == pytest.approx(50.5)
    assert np.isnan(stats.percentile_with_drops(np.array([]), 99))


def test_seed_env_bootstrap_counts_seed_noise_and_stream_noise():
    rng = np.random.default_rng(0)
    seeds, streams = 5, 16
    # Seed noise only (a value per seed, equal on every stream): the interval must be about
    # as wide as the seeds' spread says; a per-stream interval of the seed-mean would be 0.
    seed_only = np.repeat(rng.normal(0.0, 1.0, (seeds, 1)), streams, axis=1)
    b = stats.seed_env_bootstrap(seed_only)
    assert b["ci"] > 0.5 * stats.t_halfwidth(seed_only[:, 0])
    assert stats.t_halfwidth(seed_only.mean(0)) == pytest.approx(0.0, abs=1e-12)
    # Stream noise only (seeds identical): the interval matches the streams' t-interval
    # within 30% (bootstrap vs Student-t at n = 16; measured ratio ~0.9).
    stream_only = np.repeat(rng.normal(0.0, 1.0, (1, streams)), seeds, axis=0)
    b = stats.seed_env_bootstrap(stream_only)
    assert b["ci"] == pytest.approx(stats.t_halfwidth(stream_only[0]), rel=0.3)
    # Both together: wider than either alone.
    both = seed_only + stream_only
    assert stats.seed_env_bootstrap(both)["ci"] > max(
        stats.seed_env_bootstrap(seed_only)["ci"], stats.seed_env_bootstrap(stream_only)["ci"])


def test_seed_env_bootstrap_mean_nan_and_determinism():
    v = np.arange(12.0).reshape(3, 4)
    v[1, 2] = np.nan
    b = stats.seed_env_bootstrap(v, seed=3)
    assert b["mean"] == pytest.approx(np.nanmean(v))
    assert b["low"] <= b["mean"] <= b["high"]
    assert b == stats.seed_env_bootstrap(v, seed=3)
    assert (b["seeds"], b["streams"]) == (3, 4)
    assert stats.seed_env_bootstrap(np.full((2, 3), 5.0))["ci"] == 0.0
    assert stats.seed_env_bootstrap(v + 100.0)["significant"]
    with pytest.raises(ValueError, match="level"):
        stats.seed_env_bootstrap(v, level=1.5)
    with pytest.raises(ValueError, match="seeds, streams"):
        stats.seed_env_bootstrap(np.zeros((2, 2, 2)))


def test_seed_env_bootstrap_covers_the_true_mean_of_a_crossed_model():
    # y[s, e] = mu + a_s + b_e + noise, a ~ N(0, 1) (seeds), b ~ N(0, 1) (streams): the 95%
    # interval must cover mu in at least 85% of 200 fixed-seed datasets. With 5 seeds the
    # percentile bootstrap under-covers the seed term somewhat (its variance is computed
    # with 1/S, not 1/(S-1)) while the pigeonhole double-counts the noise term; 85% leaves
    # a margin of ~3.5 binomial sd below the 92% measured with these seeds.
    rng = np.random.default_rng(1)
    hits = 0
    for i in range(200):
        y = (rng.normal(0, 1, (5, 1)) + rng.normal(0, 1, (1, 12))
             + rng.normal(0, 0.5, (5, 12)))
        b = stats.seed_env_bootstrap(y, num_resamples=1000, seed=i)
        hits += b["low"] <= 0.0 <= b["high"]
    assert hits >= 170, hits
