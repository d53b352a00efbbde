"""`lanes.compacted_while` equals `lax.while_loop`, alone and under `vmap` (both phases);
`lanes.active_order` equals `jnp.nonzero`; the environments that use `compacted_while`, vmapped
over enough lanes to compact, equal single-environment runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core import lanes


def _cond(c, consts):
    i, _, limit = c
    return i < limit


def _body(c, consts):
    i, acc, limit = c
    scale, offset = consts
    # A float recurrence, so a lane that ran a wrong number of iterations shows.
    return i + 1, acc * scale + offset + i.astype(jnp.float32), limit


def _plain(c, consts):
    return jax.lax.while_loop(lambda x: _cond(x, consts), lambda x: _body(x, consts), c)


def _carry(limits):
    n = limits.shape[0]
    return (jnp.zeros((n,), jnp.int32), jnp.linspace(0.0, 1.0, n, dtype=jnp.float32), limits)


@pytest.mark.parametrize("consts_batched", [False, True])
def test_vmapped_equals_plain_loop_with_skewed_counts(consts_batched):
    # 512 lanes: most finish in 0-4 iterations, the rest need up to 60, so the dense phase
    # stops early and several compact chunks (64 lanes each) run the rest.
    rng = np.random.default_rng(0)
    limits = np.where(rng.random(512) < 0.6, rng.integers(0, 5, 512), rng.integers(5, 61, 512))
    t = next(t for t in range(61) if (limits > t).sum() <= 512 // lanes.DENSE_FRACTION)
    assert -(-(limits > t).sum() // lanes.chunk_width(512)) >= 2  # the test covers >= 2 chunks
    carry = _carry(jnp.asarray(limits, jnp.int32))
    if consts_batched:
        consts = (jnp.linspace(0.5, 0.9, 512, dtype=jnp.float32), jnp.full((512,), 0.25))
        axes = (0, 0)
    else:
        consts = (jnp.float32(0.7), jnp.float32(0.25))
        axes = (None, None)
    got = jax.jit(jax.vmap(lambda c, k: lanes.compacted_while(_cond, _body, c, k),
                           in_axes=(0, axes)))(carry, consts)
    want = jax.jit(jax.vmap(_plain, in_axes=(0, axes)))(carry, consts)
    np.testing.assert_array_equal(np.asarray(got[0]), limits)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)


def test_single_lane_and_nested_vmap():
    carry = (jnp.int32(0), jnp.float32(0.5), jnp.int32(7))
    consts = (jnp.float32(0.9), jnp.float32(0.1))
    single = lanes.compacted_while(_cond, _body, carry, consts)
    want = _plain(carry, consts)
    assert int(single[0]) == 7
    np.testing.assert_allclose(float(single[1]), float(want[1]), rtol=1e-6)
    limits = jnp.asarray(np.arange(24).reshape(3, 8) % 11, jnp.int32)
    nested = jax.vmap(jax.vmap(lambda c: lanes.compacted_while(_cond, _body, c, consts)))(
        (jnp.zeros((3, 8), jnp.int32), jnp.ones((3, 8), jnp.float32), limits))
    np.testing.assert_array_equal(np.asarray(nested[0]), np.asarray(limits))


def test_unbatched_carry_leaves_are_broadcast():
    # Only the limit is batched; the counter and accumulator start shared.
    limits = jnp.asarray([0, 3, 9, 1], jnp.int32)
    got = jax.vmap(lambda lim: lanes.compacted_while(
        _cond, _body, (jnp.int32(0), jnp.float32(1.0), lim),
        (jnp.float32(1.0), jnp.float32(0.0))))(limits)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(limits))
    # acc = 1 + sum(range(limit))
    np.testing.assert_allclose(np.asarray(got[1]), [1.0, 4.0, 37.0, 1.0])


def test_active_order_equals_nonzero():
    rng = np.random.default_rng(1)
    for rows, cols in ((37, 8), (5, 1), (64, 3)):
        active = rng.random((rows, cols)) < 0.3
        size = rows * cols + 16
        order, count = lanes.active_order(jnp.asarray(active), size)
        want = np.flatnonzero(active.ravel())
        assert int(count) == want.size
        np.testing.assert_array_equal(np.asarray(order)[:want.size], want)
        assert np.all(np.asarray(order)[want.size:] == rows * cols)


@pytest.mark.parametrize("name, steps", [("Batching-v0", 12), ("Autoscaling-v0", 3),
                                         ("LLMRouting-v0", 3)])
def test_env_compacted_loop_equals_single_environments(name, steps):
    # More lanes than MIN_COMPACT_LANES, so the env's loop (Batching-v0's and Autoscaling-v0's
    # arrival loops, the continuous engine's iterations) takes the compacted path under vmap;
    # the env contract tests use small batches, which run the plain loop.
    import jaxserve

    n = lanes.MIN_COMPACT_LANES + 32
    env, params = jaxserve.make(name)
    keys = jax.random.split(jax.random.PRNGKey(3), n)

    def rollout(key):
        _, state = env.reset(key, params)

        def step(state, k):
            action = env.action_space(params).sample(jax.random.fold_in(k, 1))
            _, state, reward, _, _, info = env.step(k, state, action, params)
            return state, (reward, info["arrived"], info["completed"])

        return jax.lax.scan(step, state, jax.random.split(key, steps))[1]

    batched = jax.jit(jax.vmap(rollout))(keys)
    single = jax.jit(rollout)
    if name == "Batching-v0":
        per_step = np.sort(np.asarray(batched[1]), axis=0)[::-1]  # (lanes, steps), descending
        # In some step the busiest lanes needed more iterations than the lane at the dense
        # phase's cut (a quarter of the lanes), so the compact chunks did run.
        assert np.any(per_step[0] > per_step[n // lanes.DENSE_FRACTION])
    arrived = np.asarray(batched[1]).sum(1)
    # Lanes with the most and fewest arrivals, so the compacted chunks' lanes are among them.
    for i in {int(arrived.argmax()), int(arrived.argmin()), 0, n - 1}:
        one = single(keys[i])
        np.testing.assert_array_equal(np.asarray(one[1]), np.asarray(batched[1][i]))
        np.testing.assert_array_equal(np.asarray(one[2]), np.asarray(batched[2][i]))
        np.testing.assert_allclose(np.asarray(one[0]), np.asarray(batched[0][i]), rtol=1e-4,
                                   atol=1e-4)
