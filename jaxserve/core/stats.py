"""Confidence intervals and paired comparisons: the one place the evaluation code gets them.

Every comparison in jaxserve treats an environment (or episode) as one independent
replicate. Intervals are Student-t intervals of the replicates' mean (n - 1 degrees of
freedom), never the normal 1.96 approximation, which is too narrow for the handful of
replicates a CPU run affords. Policies evaluated on one key see the same streams (common
random numbers), so compare them with `paired_difference`, not by whether their separate
intervals overlap. A learned policy trained with several seeds and evaluated on common streams
is a crossed (seed x stream) table: `seed_env_bootstrap` gives its mean, or its paired
difference with a heuristic, a CI that counts training and evaluation noise together.

Percentiles are exact (no histogram): `percentiles` interpolates linearly between order
statistics (`numpy.percentile`'s default) over the finite values, on the host;
`percentiles_jax` is the same definition in JAX for jitted code, where the number of finite
values is traced; `percentile_with_drops` counts NaN (a dropped request) as infinitely late,
so a policy cannot lower its tail by dropping.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import t as student_t


def _t_quantile(level: float, dof) -> np.ndarray:
    return student_t.ppf(0.5 + level / 2.0, dof)


def t_halfwidth(values, level: float = 0.95, axis: int | None = None):
    """Half-width of the Student-t CI (two-sided, `level`) of the mean of `values`.

    With `axis=None` (default) non-finite values are left out and the result is a float
    (NaN with fewer than 2 finite values). With an `axis`, the interval is taken along it,
    every value counting, and the result is an array (NaN where that axis has < 2 entries).
    """
    v = np.asarray(values, np.float64)
    if axis is None:
        v = v[np.isfinite(v)]
        n = v.shape[0]
        if n < 2:
            return float("nan")
        return float(_t_quantile(level, n - 1) * v.std(ddof=1) / np.sqrt(n))
    n = v.shape[axis]
    if n < 2:
        return np.full(np.delete(v.shape, axis % v.ndim), np.nan)
    return _t_quantile(level, n - 1) * v.std(axis=axis, ddof=1) / np.sqrt(n)


def paired_difference(a, b, level: float = 0.95) -> dict:
    """Paired comparison of two policies evaluated on common random numbers.

    `a`, `b`: per-replicate values of one metric (e.g. `per_env["mean_latency"]`), replicate
    `i` of both on the same stream. The CI is the Student-t interval of the differences
    `a_i - b_i` (n - 1 degrees of freedom): common streams cancel most of the between-stream
    variance, so it is much narrower than the unpaired CIs suggest. Replicates where either
    value is NaN are left out.

    Returns:
      dict: `mean` (of a - b), `ci` (half-width), `low`, `high`, `n`, and `significant`
      (the interval excludes 0).
    """
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"paired values need equal lengths, got {a.shape[0]} and {b.shape[0]}")
    d = a - b
    d = d[np.isfinite(d)]
    n = int(d.shape[0])
    mean = float(d.mean()) if n else float("nan")
    half = t_halfwidth(d, level)
    return {"mean": mean, "ci": half, "low": mean - half, "high": mean + half, "n": n,
            "significant": bool(np.isfinite(half) and (mean - half > 0 or mean + half < 0))}


def seed_env_bootstrap(values, level: float = 0.95, num_resamples: int = 4000,
                       seed: int = 0) -> dict:
    """Mean of a (training seed x evaluation stream) table with a CI that counts both noises.

    `values[s, e]`: one metric (or a paired difference, learned - heuristic) of training seed
    `s` on evaluation stream `e`; every seed sees the same streams (common random numbers), so
    seeds and streams are *crossed*, not nested. The interval is the percentile interval of
    the pigeonhole bootstrap for crossed random effects (Owen, 2007, Ann. Appl. Stat. 1(2)):
    each resample draws `S` seeds and, independently, `E` streams with replacement and takes
    the mean of the selected `S x E` cells. Resampling the seeds carries the training noise,
    resampling the streams the evaluation noise (including the heuristic's own, which a
    per-seed mean over the same streams would hide); Owen shows the variance estimate is
    conservative (it double-counts the interaction term), never anti-conservative. A single
    row (`S = 1`, e.g. a heuristic) reduces to the ordinary bootstrap over streams.

    Cells that are NaN are left out of each resample's mean. Deterministic for a `seed`.

    Returns:
      dict: `mean` (of all finite cells), `low`, `high` (the percentile interval), `ci`
      (half its width), `seeds`, `streams`, and `significant` (the interval excludes 0).
    """
    v = np.asarray(values, np.float64)
    if v.ndim == 1:
        v = v[None, :]
    if v.ndim != 2 or v.shape[0] < 1 or v.shape[1] < 1:
        raise ValueError(f"values must be a (seeds, streams) array, got shape {v.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    s, e = v.shape
    finite = np.isfinite(v)
    mean = float(v[finite].mean()) if finite.any() else float("nan")
    rng = np.random.default_rng(seed)
    si = rng.integers(0, s, (num_resamples, s))
    ei = rng.integers(0, e, (num_resamples, e))
    # Cell (i, j) is picked count_s[i] * count_e[j] times: a weighted mean, no S x E copies.
    ws = np.zeros((num_resamples, s))
    we = np.zeros((num_resamples, e))
    np.add.at(ws, (np.arange(num_resamples)[:, None], si), 1.0)
    np.add.at(we, (np.arange(num_resamples)[:, None], ei), 1.0)
    x, m = np.where(finite, v, 0.0), finite.astype(np.float64)
    num = np.einsum("rs,se,re->r", ws, x, we)
    den = np.einsum("rs,se,re->r", ws, m, we)
    boot = np.where(den > 0, num / np.maximum(den, 1.0), np.nan)
    boot = boot[np.isfinite(boot)]
    if boot.size == 0 or s * e < 2:
        low = high = float("nan")
    else:
        low, high = (float(q) for q in np.percentile(boot, [50 * (1 - level),
                                                              50 * (1 + level)]))
    half = (high - low) / 2.0
    return {"mean": mean, "low": low, "high": high, "ci": half, "seeds": s, "streams": e,
            "significant": bool(np.isfinite(half) and (low > 0 or high < 0))}


def percentiles(values, qs) -> np.ndarray:
    """Exact percentiles `qs` (in [0, 100]) of the finite `values`, linear interpolation.

    Returns float64 `(len(qs),)`; NaN everywhere when no value is finite.
    """
    v = np.asarray(values, np.float64).ravel()
    v = v[np.isfinite(v)]
    qs = np.atleast_1d(np.asarray(qs, np.float64))
    return np.percentile(v, qs) if v.size else np.full(qs.shape, np.nan)


def percentiles_jax(values: jax.Array, qs) -> jax.Array:
    """`percentiles` in JAX (jit- and vmap-safe): the same definition, in `values`' dtype.

    Non-finite entries are masked out (as NaN for `jnp.nanpercentile`), so a fixed-size array
    with a traced number of valid entries needs no dynamic shape.

    Returns `(len(qs),)`; NaN everywhere when no value is finite.
    """
    v = jnp.ravel(values)
    v = jnp.where(jnp.isfinite(v), v, jnp.nan)
    return jnp.nanpercentile(v, jnp.atleast_1d(jnp.asarray(qs, v.dtype)))


def percentile_with_drops(values, q: float) -> float:
    """The `q`-th percentile (linear interpolation) with NaN (dropped) counted as `+inf`.

    Interpolates as `x[lo] + frac * (x[hi] - x[lo])` and returns `x[lo]` when the two order
    statistics are equal, so a tail of infinities gives `inf`, never NaN. NaN for no values.
    """
    x = np.sort(np.where(np.isnan(values), np.inf, values).ravel())
    if x.size == 0:
        return float("nan")
    pos = q / 100.0 * (x.size - 1)
    lo = int(np.floor(pos))
    hi = min(lo + 1, x.size - 1)
    frac = pos - lo
    if frac == 0.0 or x[hi] == x[lo]:
        return float(x[lo])
    return float(x[lo] + frac * (x[hi] - x[lo]))
