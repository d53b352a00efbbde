"""`jax.random.uniform` and `jax.random.split`, bit for bit, with the hash unrolled.

JAX lowers its Threefry-2x32 hash on CPU as a `fori_loop` over its five round groups (to
keep compile time down). Under `vmap`, inside the environments' steps and their per-arrival
event loops, each call then costs a small while loop of ~90 XLA thunk executions (the round
bodies, the loop carries' copies, the loop test), and at a few hundred environments per
batch a step is bound by how many thunks it runs (`docs/benchmarks.md`). The functions
here compute the same hash with the rounds unrolled, which XLA fuses into one elementwise
kernel, and return exactly what `jax.random` returns for the same key: the same bits, so the
same episodes. They apply when the key is a Threefry-2x32 key (a raw `uint32[2]` key under
the default implementation, or a typed `jax.random.key`) and JAX's
`jax_threefry_partitionable` mode is on (the default since JAX 0.5); otherwise they call
`jax.random` itself. `tests/test_rng.py` checks the bit equality.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotl(x: jax.Array, d: int) -> jax.Array:
    return (x << np.uint32(d)) | (x >> np.uint32(32 - d))


@jax.jit
def threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array):
    """The Threefry-2x32 hash (20 rounds) of counters `(x1, x2)` under key `(k1, k2)`, all
    uint32 (broadcast together); the function `jax.random` applies, unrolled.

    Jitted so that each draw shows in a jaxpr as one `jit` equation named `threefry2x32`
    (what `tests/test_engine_step_prng.py` counts); XLA inlines it.
    """
    ks = (k1, k2, k1 ^ k2 ^ _PARITY)
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for group in range(5):
        for r in _ROTATIONS[group % 2]:
            x1 = x1 + x2
            x2 = _rotl(x2, r) ^ x1
        x1 = x1 + ks[(group + 1) % 3]
        x2 = x2 + ks[(group + 2) % 3] + np.uint32(group + 1)
    return x1, x2


def _raw_threefry_key(key: jax.Array):
    """`(uint32[2] key data, typed key impl or None)` when `key` is a single Threefry-2x32
    key and the fast path reproduces `jax.random`; None otherwise."""
    if not jax.config.jax_threefry_partitionable:
        return None
    key = jnp.asarray(key)
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(key)
        if key.shape != () or "threefry" not in str(impl):
            return None
        return jax.random.key_data(key), impl
    if key.dtype != jnp.uint32 or key.shape != (2,) or \
            jax.config.jax_default_prng_impl != "threefry2x32":
        return None
    return key, None


def _counters(n: int):
    """The flat counters `jax.random` hashes for `n` outputs: (high, low) words of 0..n-1."""
    return jnp.zeros((n,), jnp.uint32), jnp.arange(n, dtype=jnp.uint32)


def uniforms(key: jax.Array, n: int, minval: float = float(np.finfo(np.float32).tiny),
             maxval: float = 1.0) -> jax.Array:
    """`jax.random.uniform(key, (n,), float32, minval, maxval)`, bit for bit: `n` float32
    uniforms in `[minval, maxval)` (by default in (0, 1): never exactly 0, so a log of one is
    finite)."""
    raw = _raw_threefry_key(key)
    if raw is None:
        return jax.random.uniform(key, (n,), jnp.float32, minval=minval, maxval=maxval)
    data, _ = raw
    b1, b2 = threefry2x32(data[0], data[1], *_counters(n))
    bits = ((b1 ^ b2) >> np.uint32(32 - 23)) | np.float32(1.0).view(np.uint32)
    floats = jax.lax.bitcast_convert_type(bits, jnp.float32) - np.float32(1.0)
    lo, hi = np.float32(minval), np.float32(maxval)
    return jnp.maximum(lo, floats * (hi - lo) + lo)


def split(key: jax.Array, num: int = 2) -> jax.Array:
    """`jax.random.split(key, num)`, bit for bit (raw keys give raw keys, typed give typed)."""
    raw = _raw_threefry_key(key)
    if raw is None:
        return jax.random.split(key, num)
    data, impl = raw
    b1, b2 = threefry2x32(data[0], data[1], *_counters(num))
    out = jnp.stack([b1, b2], axis=-1)
    return out if impl is None else jax.random.wrap_key_data(out, impl=impl)
