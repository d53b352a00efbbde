"""LLMRouting-v0 specifics: defaults, episode horizons, overload, invalid actions, replay,
parameter checks, the SLO reward. The gymnax contract every registered environment shares
(step outputs, truncation, one trace, vmap over environments and parameters) is
tests/test_env_contract.py."""

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


def test_episode_horizons_are_drawn_at_reset():
    """LLMRouting-v0 draws each episode's horizon at reset from [3, 5] (`episode_horizon`:
    ceil(5 / 2) to 5), so that vmapped episodes drift apart: over 10+ episodes every length
    appears, each a truncation (synthetic arrivals never terminate) that auto-resets. The
    rest of the gymnax contract (dtypes, spaces, one trace, same key same result, vmap over
    environments and parameters equal to a loop) is tests/test_env_contract.py's, run on
    LLMRouting-v0 with a lane of 4x the arrival rate on half the KV blocks."""
    env, params = small()
    params = params.replace(max_steps_in_episode=jnp.int32(5))
    state, (obs, rew, term, trunc, info) = run(env, params, jax.random.PRNGKey(0), STEPS)
    assert not bool(term.any())
    ends = np.flatnonzero(np.asarray(trunc))
    lengths = np.diff(np.concatenate([[-1], ends]))
    assert set(lengths.tolist()) == {3, 4, 5}  # 10+ episodes: every length appears
    assert int(state.time) == STEPS - 1 - ends[-1]


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
    (dict(reward="latency"), "reward"),
    (dict(shaping_gamma=1.5), "shaping_gamma"),
    (dict(slo_ttft_s=-1.0), "slo_ttft_s"),
])
def test_bad_params_raise_naming_field(bad, field):
    with pytest.raises(ValueError, match=field):
        jaxserve.make("LLMRouting-v0", **bad)



def test_params_are_checked_as_the_profile_type_they_hold():
    """LLM envs validate their `ReplicaProfile`s as replicas (no stand-in GPU profile): a
    static-batching `GPUProfile` is refused, and a replica's `max_seqs` beyond the static
    running slots is named by its own field, for LLMRouting-v0 and LLMAutoscaling-v0."""
    env, params = jaxserve.make("LLMRouting-v0", replicas=REPLICAS)
    gpu_params = jaxserve.make("Routing-v0")[1].gpus
    with pytest.raises(ValueError, match="must be a stacked ReplicaProfile"):
        env.check_params(params.replace(gpus=gpu_params))
    big = params.gpus.replace(max_seqs=params.gpus.max_seqs * 0 + env.max_seqs + 1)
    with pytest.raises(ValueError, match=r"params\.gpus\.max_seqs .* static running slots"):
        env.check_params(params.replace(gpus=big))
    # Fewer static slots than the profiles' max_seqs: the message names both ways out.
    with pytest.raises(ValueError, match=r"larger max_seqs, or give the replicas max_seqs <= 8"):
        jaxserve.make("LLMRouting-v0", max_seqs=8)
    env, params = jaxserve.make("LLMAutoscaling-v0")
    serving = params.serving
    big = serving.gpus.replace(max_seqs=serving.gpus.max_seqs * 0 + env.max_seqs + 1)
    with pytest.raises(ValueError, match=r"params\.serving\.gpus\.max_seqs"):
        env.check_params(params.replace(serving=serving.replace(gpus=big)))
    with pytest.raises(ValueError, match="must be a stacked ReplicaProfile"):
        env.check_params(params.replace(serving=serving.replace(gpus=gpu_params)))

def test_registered_features_bounded_at_10x_load():
    """Every feature of the registered scenario stays finite and O(1) at 10x its load: the
    fractions are <= 2 (waiting counts preempted requests too) and the log features grow
    only logarithmically with the backlog."""
    env, params = jaxserve.make("LLMRouting-v0")
    params = params.replace(arrivals=A.poisson(10 * float(params.arrivals.rates[0])))
    _, (obs, rew, term, trunc, info) = run(env, params, jax.random.PRNGKey(0), 400)
    obs = np.asarray(obs)
    assert np.all(np.isfinite(obs)) and np.all(np.isfinite(np.asarray(rew)))
    assert obs.min() >= 0.0 and obs.max() <= 10.0, obs.max(0)
    assert env.observation_space(params).contains(jnp.asarray(obs[-1]))
    assert obs[:, 3:].reshape(len(obs), env.num_replicas, -1)[:, :, 0].max() > 0.5  # loaded


def test_slo_reward_counts_match_replay_metrics():
    """`reward="slo"` counts each finished request's TTFT/TPOT attainment as
    `llm_metrics.slo_attainment` does from a replay, both with the recycled token-log slots
    of training (no log) and with a replay's per-request log."""
    from jaxserve.core.sources import trace_arrays
    from jaxserve.envs.base import with_static
    from jaxserve.evaluation import llm_metrics
    from jaxserve.evaluation.evaluate import trace_env
    from jaxserve.policies import llm_routing as P

    targets = dict(slo_ttft_s=0.3, slo_tpot_s=0.03)
    env, params = small(reward="slo", **targets)
    rng = np.random.default_rng(1)
    n = 60
    tr = jaxserve.Trace(np.cumsum(rng.exponential(0.08, n)), rng.integers(10, 600, n),
                        rng.integers(1, 120, n))
    out = jaxserve.replay(env, params, tr, policy=P.jsq_requests)
    att = llm_metrics.slo_attainment(out, tr.output_tokens, targets["slo_ttft_s"],
                                     targets["slo_tpot_s"])
    met_ref = int(att["met"].sum())
    assert 0 < met_ref < n - int(out["dropped"].sum())  # the targets bind for some requests
    p = params.replace(trace=trace_arrays(tr))
    for e in (with_static(env, trace_len=n), trace_env(env, n)):
        # Jitted (the reset too: op by op it compiled ~165 small programs, ~4 s): op by op,
        # each step's engine loop dispatched ~150 s of small ops.
        obs, state = jax.jit(e.reset_env)(jax.random.PRNGKey(0), p)
        step = jax.jit(lambda k, s, p_: e.step_env(k, s, P.jsq_requests(None, None, s, p_),
                                                   p_))
        met = missed = dropped = 0
        for i in range(n):
            obs, state, r, term, info = step(jax.random.PRNGKey(i), state, p)
            met += int(info["slo_attained"])
            missed += int(info["slo_missed"])
            dropped += int(info["dropped"])
        assert bool(term)
        assert met == met_ref and met + missed + dropped == n
