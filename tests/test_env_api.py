"""Routing-v0 and Batching-v0 specifics: load sweeps by vmap over params, overload, invalid and
infeasible actions, parameter and trace validation, replay errors. The contract every registered
environment shares (gymnax 1.0 step, truncation, legacy wrapper, retracing, vmap over envs and
params) is tests/test_env_contract.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.core import arrivals as A

ENV_NAMES = ("Routing-v0", "Batching-v0")


def small(name, **kw):
    return jaxserve.make(name, max_steps_in_episode=kw.pop("max_steps_in_episode", 8), **kw)


def rollout(env, params, key, num_steps, action_fn=None):
    """Scan `num_steps` random (or given) actions; returns stacked step outputs.

    Tests call it through `run`, one compiled program per (env, num_steps): equal
    environments hash equal, so tests share compilations.
    """
    obs, state = env.reset(key, params)

    def step(carry, k):
        state = carry
        k_a, k_s = jax.random.split(k)
        a = env.action_space(params).sample(k_a) if action_fn is None else action_fn(k_a, state)
        obs, state, r, term, trunc, info = env.step(k_s, state, a, params)
        return state, (obs, r, term, trunc, info)

    return jax.lax.scan(step, state, jax.random.split(key, num_steps))


run = jax.jit(rollout, static_argnums=(0, 3))


def test_registry_and_errors():
    assert set(ENV_NAMES) <= set(jaxserve.registered_envs())
    with pytest.raises(ValueError, match="unknown environment 'Nope-v0'"):
        jaxserve.make("Nope-v0")
    with pytest.raises(ValueError, match="unknown environment parameter 'bogus'"):
        jaxserve.make("Routing-v0", bogus=1)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_vmap_over_params_and_dtypes_survive_scan(name):
    env, params = small(name)
    rates = jnp.asarray([0.5, 2.0, 8.0], jnp.float32)
    batch = jax.vmap(lambda r: params.replace(arrivals=A.poisson(1.0).replace(
        rates=r[None])))(rates)
    state, (obs, rew, term, trunc, info) = jax.jit(
        jax.vmap(rollout, in_axes=(None, 0, None, None)), static_argnums=(0, 3))(
        env, batch, jax.random.PRNGKey(0), 16)
    assert obs.shape[:2] == (3, 16)
    # Higher load keeps more requests in the system on average (time-average of N(t)).
    mean_n = info["in_system_time"].sum(1) / info["elapsed"].sum(1)
    assert float(mean_n[2]) > float(mean_n[0])
    _, state0 = env.reset(jax.random.PRNGKey(0), params)
    for a, b in zip(jax.tree.leaves(state0), jax.tree.leaves(state)):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_overload_drops_counted_and_finite(name):
    env, params = small(name, arrival_rate=2000.0, max_steps_in_episode=400,
                        gpus=[jaxserve.GPUProfile(queue_cap=8, max_batch=4)] * (
                            1 if name == "Batching-v0" else 3))
    _, (obs, rew, term, trunc, info) = run(env, params, jax.random.PRNGKey(0), 300)
    for leaf in jax.tree.leaves((obs, rew, info)):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    assert int(info["dropped"].sum()) > 0


def test_routing_invalid_actions_clipped_and_counted():
    env, params = small("Routing-v0")
    _, state = env.reset(jax.random.PRNGKey(0), params)
    for a, expect_gpu in ((-3, 0), (99, env.num_gpus - 1)):
        *_, info = env.step_env(jax.random.PRNGKey(1), state, jnp.int32(a), params)
        assert int(info["invalid_actions"]) == 1
    _, s2, *_ = env.step_env(jax.random.PRNGKey(1), state, jnp.int32(99), params)
    held = np.asarray(s2.cluster.queues.count + s2.cluster.servers.run_count)
    assert held[env.num_gpus - 1] == 1 and held.sum() == 1


def test_batching_infeasible_actions_counted():
    env, params = small("Batching-v0")
    _, state = env.reset(jax.random.PRNGKey(0), params)
    q = int(state.cluster.queues.count[0])
    *_, info = env.step_env(jax.random.PRNGKey(1), state, jnp.int32(env.max_batch + 5), params)
    assert int(info["invalid_actions"]) == 1
    *_, info = env.step_env(jax.random.PRNGKey(1), state, jnp.int32(q), params)
    assert int(info["invalid_actions"]) == 0


def test_batching_wait_features_are_the_true_waits():
    # The head's and the mean wait come from the relative arrivals (stored + offset). They
    # once read the stored arrivals alone, which lag by the offset that builds up between a
    # queue's pushes: the features showed the previous decision's waits.
    from jaxserve.core import queues as Q

    env, params = small("Batching-v0", max_steps_in_episode=100)
    _, state = env.reset(jax.random.PRNGKey(0), params)
    step = jax.jit(env.step_env)
    lagged = 0
    for i in range(30):
        action = jnp.int32(0 if i % 3 else 2)  # mostly wait, so queues and offsets build up
        obs, state, *_ = step(jax.random.PRNGKey(i + 1), state, action, params)
        q = state.cluster.queues
        mask = np.asarray(Q.waiting_mask(q)[0])
        waits = -np.asarray(Q.arrival_times(q)[0], np.float64)[mask]
        ts = float(params.time_scale)
        np.testing.assert_allclose(float(obs[2]), waits.max() / ts, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(obs[3]), waits.mean() / ts, rtol=1e-5, atol=1e-6)
        lagged += float(q.offset[0]) < -1e-3
    assert lagged > 10  # the offsets did build up, so the check above could fail


@pytest.mark.parametrize("bad, field", [
    (dict(arrival_rate=-1.0), "arrivals.rates"),
    (dict(arrival_rate=float("nan")), "arrivals.rates"),
    (dict(gpus=[jaxserve.GPUProfile(max_batch=0)]), "max_batch"),
    (dict(gpus=[jaxserve.GPUProfile(beta=-0.1)]), "beta"),
    (dict(gpus=[]), "zero GPUs"),
    (dict(slo_s=float("nan")), "slo_s"),
    (dict(max_steps_in_episode=0), "max_steps_in_episode"),
])
def test_bad_params_raise_naming_field(bad, field):
    with pytest.raises(ValueError, match=field):
        jaxserve.make("Routing-v0", **bad)


@pytest.mark.parametrize("bad, field", [
    (dict(arrival_s=[0.0, 2.0, 1.0]), "non-decreasing"),
    (dict(arrival_s=[0.0, np.nan, 1.0]), "arrival_s"),
    (dict(prompt_tokens=[1, 2]), "prompt_tokens"),
    (dict(output_tokens=[1, 0, 3]), "output_tokens"),
])
def test_bad_trace_raises(bad, field):
    good = dict(arrival_s=[0.0, 1.0, 2.0], prompt_tokens=[1, 2, 3], output_tokens=[1, 2, 3])
    env, params = jaxserve.make("Routing-v0")
    with pytest.raises(ValueError, match=field):
        jaxserve.replay(env, params, jaxserve.Trace(**{**good, **bad}), actions=[0, 0, 0])


def test_replay_rejects_bad_actions():
    env, params = jaxserve.make("Routing-v0")
    tr = jaxserve.Trace(np.arange(3.0), np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match="one entry per request"):
        jaxserve.replay(env, params, tr, actions=[0, 1])
    with pytest.raises(ValueError, match=r"actions\[1\]"):
        jaxserve.replay(env, params, tr, actions=[0, 7, 0])
