"""`core.rng` returns exactly what `jax.random` returns (same bits), with the hash unrolled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core import rng

TINY = float(np.finfo(np.float32).tiny)
KEYS = jax.random.split(jax.random.PRNGKey(2026), 512)  # fixed keys, raw uint32[2]


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("n", [1, 5, 33])
def test_uniforms_equal_jax_random_bit_for_bit(n):
    ours = jax.jit(jax.vmap(lambda k: rng.uniforms(k, n)))(KEYS)
    ref = jax.vmap(lambda k: jax.random.uniform(k, (n,), jnp.float32, minval=TINY,
                                                maxval=1.0))(KEYS)
    _same(ours, ref)
    assert ours.dtype == jnp.float32 and float(ours.min()) > 0.0 and float(ours.max()) < 1.0


def test_uniforms_other_range_equal_jax_random():
    ours = jax.vmap(lambda k: rng.uniforms(k, 4, minval=-1.0, maxval=1.0))(KEYS)
    ref = jax.vmap(lambda k: jax.random.uniform(k, (4,), minval=-1.0, maxval=1.0))(KEYS)
    _same(ours, ref)


@pytest.mark.parametrize("num", [2, 3, 7])
def test_split_equals_jax_random_bit_for_bit(num):
    _same(jax.jit(jax.vmap(lambda k: rng.split(k, num)))(KEYS),
          jax.vmap(lambda k: jax.random.split(k, num))(KEYS))


def test_typed_keys_stay_typed_and_equal():
    key = jax.random.key(7)
    out = rng.split(key, 3)
    assert jax.dtypes.issubdtype(out.dtype, jax.dtypes.prng_key)
    _same(jax.random.key_data(out), jax.random.key_data(jax.random.split(key, 3)))
    _same(rng.uniforms(key, 6), jax.random.uniform(key, (6,), minval=TINY))


def test_other_key_implementations_fall_back_to_jax_random():
    key = jax.random.key(7, impl="rbg")
    _same(rng.uniforms(key, 6), jax.random.uniform(key, (6,), minval=TINY))
    _same(jax.random.key_data(rng.split(key)), jax.random.key_data(jax.random.split(key)))


def test_hash_is_unrolled_no_loop_in_the_program():
    # The point of the module: on CPU jax.random's hash is a while loop; ours is straight-line.
    hlo = jax.jit(jax.vmap(lambda k: rng.uniforms(k, 5))).lower(KEYS).as_text()
    assert "while" not in hlo
