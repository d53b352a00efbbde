"""gymnax 1.0 contract, jit/vmap behaviour and input validation of Routing-v0 and Batching-v0."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnax.wrappers.compat import LegacyStepAPIWrapper

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
run_batched = jax.jit(jax.vmap(rollout, in_axes=(None, None, 0, None)), static_argnums=(0, 3))


def test_registry_and_errors():
    assert set(ENV_NAMES) <= set(jaxserve.registered_envs())
    with pytest.raises(ValueError, match="unknown environment 'Nope-v0'"):
        jaxserve.make("Nope-v0")
    with pytest.raises(ValueError, match="unknown environment parameter 'bogus'"):
        jaxserve.make("Routing-v0", bogus=1)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_step_contract_and_truncation(name):
    env, params = small(name, max_steps_in_episode=5)
    key = jax.random.PRNGKey(0)
    obs, state = env.reset(key, params)
    assert env.observation_space(params).contains(obs)
    flags = []
    for i in range(6):
        out = env.step(jax.random.PRNGKey(i), state, jnp.int32(1), params)
        assert len(out) == 6
        obs, state, reward, terminated, truncated, info = out
        assert obs.dtype == jnp.float32 and reward.dtype == jnp.float32
        assert terminated.dtype == jnp.bool_ and truncated.dtype == jnp.bool_
        assert "final_observation" in info and info["final_observation"].shape == obs.shape
        assert env.observation_space(params).contains(obs)
        flags.append((bool(terminated), bool(truncated)))
    # Synthetic arrivals never terminate; the 5th decision truncates and the env auto-resets.
    assert flags[4] == (False, True) and flags[5] == (False, False)
    assert int(state.time) == 1


@pytest.mark.parametrize("name", ENV_NAMES)
def test_legacy_wrapper_returns_five_values(name):
    env, params = small(name, max_steps_in_episode=2)
    legacy = LegacyStepAPIWrapper(env)
    _, state = legacy.reset(jax.random.PRNGKey(0), params)
    dones = []
    for i in range(2):
        out = legacy.step(jax.random.PRNGKey(i), state, 1, params)
        assert len(out) == 5
        _, state, _, done, info = out
        dones.append(bool(done))
        assert "truncated" in info
    assert dones == [False, True]


@pytest.mark.parametrize("name", ENV_NAMES)
def test_one_trace_same_key_same_result(name):
    chex.clear_trace_counter()
    env, params = small(name)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(key, params):
        return rollout(env, params, key, 16)

    a = run(jax.random.PRNGKey(3), params)
    b = run(jax.random.PRNGKey(3), params)
    c = run(jax.random.PRNGKey(4), params)  # a new key must not retrace
    chex.assert_trees_all_equal(a, b)
    assert not np.array_equal(np.asarray(a[1][1]), np.asarray(c[1][1]))


@pytest.mark.parametrize("name", ENV_NAMES)
def test_vmap_over_envs_equals_loop(name):
    env, params = small(name)
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    batched = run_batched(env, params, keys, 16)
    for i, k in enumerate(keys):
        single = run(env, params, k, 16)
        one = jax.tree.map(lambda x: x[i], batched)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(single)):
            if jnp.issubdtype(a.dtype, jnp.floating):
                # XLA:CPU may round exp/log differently in the last bit under vmap; the
                # event sequence (every count and flag) must still be identical.
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
            else:
                np.testing.assert_array_equal(a, b)


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
