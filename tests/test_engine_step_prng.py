"""Routing-v0 draws once per step: one PRNG call, shared by the step and its auto-reset.

The documented stream (`Routing`, Randomness): `step(key)` equals `step_env(key)` while the
episode goes on and starts the next episode as `reset_env(key)` does, the new episode's
first request being drawn from the same uniforms as the terminal state's pending request.
"""

import chex
import jax.extend  # noqa: F401 (jaxprs_in_params)
import jax
import jax.numpy as jnp
import numpy as np

import jaxserve

RANDOM_PRIMITIVES = {"random_bits", "random_split", "random_fold_in", "threefry2x32"}


def is_random_call(eqn) -> bool:
    """A PRNG primitive, or `core.rng`'s unrolled hash (a `jit` named threefry2x32)."""
    return eqn.primitive.name in RANDOM_PRIMITIVES or (
        eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == "threefry2x32")


def count_random_calls(jaxpr) -> int:
    """PRNG calls in a jaxpr, sub-jaxprs (jit, loops, conds) included; `core.rng`'s hash
    counts once (its body holds no PRNG primitive)."""
    n = 0
    for eqn in jaxpr.eqns:
        if is_random_call(eqn):
            n += 1
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += count_random_calls(sub)
    return n


def small_env(**kw):
    return jaxserve.make("Routing-v0", gpus=[jaxserve.GPUProfile(max_batch=4, queue_cap=4)] * 3,
                         max_steps_in_episode=3, **kw)


def test_a_routing_step_makes_one_prng_call():
    env, params = small_env()
    _, state = env.reset(jax.random.PRNGKey(0), params)
    jaxpr = jax.make_jaxpr(lambda k, s: env.step(k, s, jnp.int32(1), params))(
        jax.random.PRNGKey(1), state)
    assert count_random_calls(jaxpr.jaxpr) == 1
    # The split default (Batching-v0) makes more: the count is not trivially 1.
    benv, bparams = jaxserve.make("Batching-v0", max_steps_in_episode=3)
    _, bstate = benv.reset(jax.random.PRNGKey(0), bparams)
    bjaxpr = jax.make_jaxpr(lambda k, s: benv.step(k, s, jnp.int32(1), bparams))(
        jax.random.PRNGKey(1), bstate)
    assert count_random_calls(bjaxpr.jaxpr) > 1


def test_step_follows_the_documented_stream():
    env, params = small_env()
    _, state = env.reset(jax.random.PRNGKey(0), params)
    step = jax.jit(env.step)
    step_env = jax.jit(env.step_env)
    for i in range(1, 4):  # max_steps_in_episode = 3: the third step truncates
        key = jax.random.PRNGKey(10 + i)
        obs, new, reward, term, trunc, info = step(key, state, jnp.int32(i % 3), params)
        obs_env, new_env, reward_env, term_env, _ = step_env(key, state, jnp.int32(i % 3),
                                                             params)
        np.testing.assert_array_equal(np.asarray(reward), np.asarray(reward_env))
        np.testing.assert_array_equal(np.asarray(info["final_observation"]), np.asarray(obs_env))
        if i < 3:
            assert not bool(trunc)
            chex.assert_trees_all_equal(new, new_env)
            np.testing.assert_array_equal(np.asarray(obs), np.asarray(obs_env))
        else:
            assert bool(trunc)
            obs_re, state_re = env.reset_env(key, params)
            np.testing.assert_array_equal(np.asarray(obs), np.asarray(obs_re))
            for f in ("head", "count", "work", "estimate_sum", "offset"):
                np.testing.assert_array_equal(np.asarray(getattr(new.cluster.queues, f)),
                                              np.asarray(getattr(state_re.cluster.queues, f)))
            chex.assert_trees_all_equal(
                (new.cluster.servers, new.cluster.waiting, new.pending, new.phase,
                 new.trace_pos, new.time),
                (state_re.cluster.servers, state_re.cluster.waiting, state_re.pending,
                 state_re.phase, state_re.trace_pos, state_re.time))
            # Same uniforms: the reset request is the terminal state's pending one, renumbered.
            for f in ("prompt", "output", "estimate", "size_class"):
                assert float(getattr(new.pending, f)) == float(getattr(new_env.pending, f))
            assert int(new.pending.req_id) == 0 and int(new_env.pending.req_id) == 3
        state = new
