"""gymnax 1.0 contract, jit/vmap behaviour and robustness of LLMRouting-v0."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.core import arrivals as A
from jaxserve.envs.base import FEATURE_CLIP

# Small replicas keep compilation and steps cheap: 8 running slots, 8 queue slots.
REPLICAS = [jaxserve.replica_profile("opt13b-a100-80g", max_seqs=8, queue_cap=8),
            jaxserve.replica_profile("opt13b-a100-40g", max_seqs=8, queue_cap=8)]


def small(**kw):
    kw.setdefault("max_steps_in_episode", 8)
    kw.setdefault("replicas", REPLICAS)
    return jaxserve.make("LLMRouting-v0", **kw)


def rollout(env, params, key, num_steps):
    obs, state = env.reset(key, params)

    def step(state, k):
        k_a, k_s = jax.random.split(k)
        a = env.action_space(params).sample(k_a)
        obs, state, r, term, trunc, info = env.step(k_s, state, a, params)
        return state, (obs, r, term, trunc, info)

    return jax.lax.scan(step, state, jax.random.split(key, num_steps))


run = jax.jit(rollout, static_argnums=(0, 3))
STEPS = 48  # one step count everywhere: the tests share compiled programs


def test_registered_and_default_make():
    assert "LLMRouting-v0" in jaxserve.registered_envs()
    env, params = jaxserve.make("LLMRouting-v0")
    assert env.num_replicas == 4 and env.max_seqs == 64
    assert env.observation_space(params).shape == (3 + 4 * 7,)
    assert env.action_space(params).n == 4


def test_step_contract_auto_reset_and_spaces():
    env, params = small()
    params = params.replace(max_steps_in_episode=jnp.int32(5))
    obs0, _ = env.reset(jax.random.PRNGKey(0), params)
    assert env.observation_space(params).contains(obs0)
    state, (obs, rew, term, trunc, info) = run(env, params, jax.random.PRNGKey(0), STEPS)
    assert obs.dtype == jnp.float32 and rew.dtype == jnp.float32
    assert term.dtype == jnp.bool_ and trunc.dtype == jnp.bool_
    assert info["final_observation"].shape == obs.shape
    assert all(env.observation_space(params).contains(o) for o in obs)
    # Synthetic arrivals never terminate; every 5th decision truncates and auto-resets.
    assert not bool(term.any())
    np.testing.assert_array_equal(np.asarray(trunc), (np.arange(STEPS) + 1) % 5 == 0)
    assert int(state.time) == STEPS % 5


def test_no_retrace_and_same_key_same_result():
    env, params = small()
    a = run(env, params, jax.random.PRNGKey(3), STEPS)
    size = run._cache_size()
    b = run(env, params, jax.random.PRNGKey(3), STEPS)
    c = run(env, params.replace(slo_s=jnp.float32(5.0)), jax.random.PRNGKey(4), STEPS)
    assert run._cache_size() == size  # new keys and param values reuse the compiled program
    chex.assert_trees_all_equal(a, b)
    assert not np.array_equal(np.asarray(a[1][1]), np.asarray(c[1][1]))


def test_vmap_over_envs_and_params_equals_loop():
    """One vmapped program over (key, params) lanes equals running each lane alone."""
    env, params = small()
    rates = jnp.asarray([2.0, 20.0, 80.0], jnp.float32)
    kv = jnp.asarray([[3379, 633], [1000, 600], [400, 300]], jnp.int32)
    batch = jax.vmap(lambda r, m: params.replace(
        arrivals=A.poisson(1.0).replace(rates=r[None]),
        gpus=params.gpus.replace(kv_blocks=m)))(rates, kv)
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    state, out = jax.jit(jax.vmap(rollout, in_axes=(None, 0, 0, None)),
                         static_argnums=(0, 3))(env, batch, keys, STEPS)
    obs, rew, term, trunc, info = out
    assert obs.shape[:2] == (3, STEPS)
    _, state0 = env.reset(jax.random.PRNGKey(0), params)
    for x, y in zip(jax.tree.leaves(state0), jax.tree.leaves(state)):
        assert x.dtype == y.dtype
    for i in range(3):
        lane = jax.tree.map(lambda x: x[i], batch)
        single = run(env, lane, keys[i], STEPS)
        one = jax.tree.map(lambda x: x[i], (state, out))
        for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(single)):
            if jnp.issubdtype(x.dtype, jnp.floating):
                # XLA:CPU may round exp/log differently in the last bit under vmap.
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
            else:
                np.testing.assert_array_equal(x, y)


def test_overload_finite_and_drops_counted():
    env, params = small()
    params = params.replace(arrivals=A.poisson(2000.0), max_steps_in_episode=jnp.int32(10_000))
    _, (obs, rew, term, trunc, info) = run(env, params, jax.random.PRNGKey(0), STEPS)
    for leaf in jax.tree.leaves((obs, rew, info)):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    assert np.all((np.asarray(obs) >= 0) & (np.asarray(obs) <= FEATURE_CLIP))
    assert int(info["dropped"].sum()) > 0


def test_invalid_actions_clipped_and_counted():
    env, params = small()
    _, state = env.reset(jax.random.PRNGKey(0), params)
    step = jax.jit(env.step_env)
    for a in (-3, 99):
        *_, info = step(jax.random.PRNGKey(1), state, jnp.int32(a), params)
        assert int(info["invalid_actions"]) == 1
    _, s2, *_ = step(jax.random.PRNGKey(1), state, jnp.int32(99), params)
    held = np.asarray(s2.cluster.queues.count + s2.cluster.run.count)
    assert held[env.num_replicas - 1] == 1 and held.sum() == 1


def test_trace_terminates_and_drains():
    env, params = small()
    tr = jaxserve.Trace(np.array([0.0, 0.1, 0.2]), np.array([100, 200, 50]),
                        np.array([10, 20, 5]))
    out = jaxserve.replay(env, params, tr, actions=[0, 1, 0])
    assert set(out) == {"arrival", "replica", "first_token", "finish", "dropped", "preemptions"}
    assert np.all(out["finish"] > out["first_token"]) and np.all(out["first_token"] > out["arrival"])
    np.testing.assert_array_equal(out["replica"], [0, 1, 0])


def test_replay_with_policy():
    from jaxserve.policies import llm_routing as P

    env, params = small()
    rng = np.random.default_rng(0)
    tr = jaxserve.Trace(np.cumsum(rng.exponential(0.05, 40)), rng.integers(10, 500, 40),
                        rng.integers(1, 100, 40))
    out = jaxserve.replay(env, params, tr, policy=P.jsq_requests)
    assert not np.isnan(out["finish"][~out["dropped"]]).any()
    assert set(np.unique(out["replica"])) <= {0, 1}


@pytest.mark.parametrize("bad, field", [
    (dict(replicas=[]), "zero"),
    (dict(replicas=[jaxserve.ReplicaProfile(kv_blocks=0)]), "kv_blocks"),
    (dict(replicas=[jaxserve.ReplicaProfile(c0=-1.0)]), "c0"),
    (dict(arrival_rate=-1.0), "arrivals.rates"),
    (dict(slo_s=float("nan")), "slo_s"),
    (dict(replicas=REPLICAS, queue_buffer=4), "queue_buffer"),
])
def test_bad_params_raise_naming_field(bad, field):
    with pytest.raises(ValueError, match=field):
        jaxserve.make("LLMRouting-v0", **bad)
