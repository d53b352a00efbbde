"""Arithmetic the continuous-batching engine runs at every iteration boundary, written for
XLA:CPU (the platform its speed is measured on; docs/benchmarks.md): each function computes the
textbook operation exactly (or up to float rounding, where it says so) in a form XLA's CPU
backend runs faster, or, for the clock, more precisely. Why each exists:

- `two_sum`, `add_time`: the replica clock as an unevaluated float32 pair, so thousands of
  iterations in one decision window do not drift by an ulp each (precision, not speed).
- `div`, `mod`, `cdiv`: int32 floor and ceiling division through float32: XLA:CPU divides
  int32 arrays one element at a time.
- `rowsum`: a float row sum as a matrix-vector product: a float `reduce` fed by elementwise
  work goes to a fusion whose fixed cost per call dominates at the engine's sizes.
- `cumsum`: a log-depth prefix sum: XLA:CPU lowers `jnp.cumsum` to a quadratic
  `reduce_window`.

Each docstring gives the measurement behind it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(s, e)` with `s = fl(a + b)` and `s + e = a + b` exactly (Knuth's TwoSum)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def add_time(hi: jax.Array, lo: jax.Array, dt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The clock `hi + lo` (s) plus `dt` (s), as a new normalised float32 pair: one float32
    rounding of the pair's sum instead of one per addition."""
    s, e = two_sum(hi, dt)
    return two_sum(s, e + lo)


def div(a, b):
    """`floor(a / b)` for int32 `0 <= a <= 2^25` and `b >= 1` (token counts, at most
    `types.MAX_TOKENS` = 2^24 per request, over block sizes), exactly.

    By float32 division and one integer correction: below 2^25 the float quotient is within
    1 of the true one, and the remainder's sign fixes it. XLA:CPU divides int32 arrays one
    element at a time (LLVM has no vector integer division; `//` also takes a remainder for
    its sign fix): a ceiling division over `(1,024, 64)` slots measured 243 us against 67 us
    in float32 (lab/history/benchmarks.md, the micro-benchmarks of the section of 2026-12-06
    (midday), commits df4f552-9aa3fe6); a boundary pass divides slot arrays by the
    block size 8 times (4 in the decode-run skip, 3 in the scheduler, 1 in carrying it out).
    """
    a = jnp.asarray(a, jnp.int32)
    b = jnp.asarray(b, jnp.int32)
    q = jnp.floor(a.astype(jnp.float32) / b.astype(jnp.float32)).astype(jnp.int32)
    r = a - q * b
    return q + (r >= b).astype(jnp.int32) - (r < 0).astype(jnp.int32)


def mod(a, b):
    """`a mod b` for `div`'s `a` and `b` (in `[0, b)`)."""
    return a - div(a, b) * b


def cdiv(a, b):
    """`ceil(a / b)` for int32 `0 <= a <= 2^24` and `b >= 1` (`div`)."""
    return div(a + b - 1, b)


def rowsum(x: jax.Array) -> jax.Array:
    """`x.sum(-1)` for a float array, as a matrix-vector product with ones.

    XLA:CPU hands a float `reduce` fed by elementwise work to a YNNPACK fusion, whose fixed
    cost per call dominates at the engine's sizes (a few to a few thousand rows of 16-128
    slots): in a loop over `(1,024, 64)` / `(1,024, 96)` rows the product measured 21.5 /
    27.7 us a trip against 38.9 / 70.5 us for the reduce (lab/history/benchmarks.md, the same
    section's micro-benchmarks as `div`'s). Same
    value up to float rounding (another summation order).
    """
    return x @ jnp.ones((x.shape[-1],), x.dtype)


def cumsum(x: jax.Array) -> jax.Array:
    """Inclusive prefix sum over the last axis (a log-depth scan: XLA:CPU lowers `cumsum` to a
    quadratic `reduce_window`): Hillis and Steele's, `log2 n` shifted adds, one fusion each,
    where `associative_scan`'s work-efficient form takes ~2 per level (the engine's compact
    chunks pay per op, not per element)."""
    n = x.shape[-1]
    shift = 1
    while shift < n:
        pad = [(0, 0)] * (x.ndim - 1) + [(shift, 0)]
        x = x + jnp.pad(x[..., :n - shift], pad)
        shift *= 2
    return x
