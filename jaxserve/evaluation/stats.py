"""Confidence intervals and paired comparisons: the one place the evaluation code gets them.

Every comparison in jaxserve treats an environment (or episode) as one independent
replicate. Intervals are Student-t intervals of the replicates' mean (n - 1 degrees of
freedom), never the normal 1.96 approximation, which is too narrow for the handful of
replicates a CPU run affords. Policies evaluated on one key see the same streams (common
random numbers), so compare them with `paired_difference`, not by whether their separate
intervals overlap.

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


def _t_quantile(level: float, dof) -> np.ndarray:
    from scipy.stats import t as student_t
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
