"""LLMPrefixRouting-v0 (LLMRouting-v0 with automatic prefix caching) and its production
cache-aware routers (`policies.prefix_routing`).

Tiny scenarios keep compilation and steps cheap: two replicas of 40 blocks x 16 tokens with
4 running and 4 waiting slots, and a 32-request shared-prefix trace with 64-token hash
blocks whose sessions overlap, so prefixes are hit, blocks evicted and requests preempted.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.agents.experiments.prefix_study import ranked_router
from jaxserve import policies as P
from jaxserve.core import continuous as CB
from jaxserve.envs.base import FEATURE_CLIP, with_static
from jaxserve.envs.llm_routing import (DEFAULT_SHAPING_GAMMA, PrefixRoutingParams,
                                       pending_cached_blocks)
from jaxserve.envs.llm_prefix_routing import make_llm_prefix_routing
from jaxserve.policies import prefix_routing as PR
from jaxserve.policies.llm_routing import jsq_tokens, would_drop
from jaxserve.traces import find as find_trace
from jaxserve.traces.prefix import PrefixTrace, PrefixTree
from jaxserve.traces.prefix_synthetic import SharedPrefixConfig, generate_shared_prefix

CFG = SharedPrefixConfig(session_rate=2.0, block_tokens=64, system_tokens=128,
                         first_user_median=200, first_user_sigma=0.8, next_user_median=40,
                         output_median=24, output_sigma=0.5, max_prompt=448, think_s=1.0,
                         turns_mean=3.0)
N = 32
PT = generate_shared_prefix(N, CFG, seed=0)
REPS = [jaxserve.replica_profile("opt13b-a100-40g", block_size=16, kv_blocks=40, max_seqs=4,
                                 queue_cap=4)] * 2
STEPS = 40  # > N: the rollout crosses an episode end (termination and auto-reset)


def small(**kw):
    """The tiny scenario, in index order and shaped as LLMRouting-v0 (so that it can be
    compared with LLMRouting-v0 and driven by replica indices); keywords override."""
    kw.setdefault("replicas", REPS)
    kw.setdefault("trace", PT)
    kw.setdefault("ranked", False)
    kw.setdefault("shaping_gamma", DEFAULT_SHAPING_GAMMA)
    return make_llm_prefix_routing(**kw)


def rollout(env, params, key, actions):
    """Steps `env` (auto-reset) with the given actions; per step the observation, reward,
    flags, info and the block accounting / audit of the state after the step."""
    obs, state = env.reset(key, params)

    def step(state, x):
        k, a = x
        obs, state, r, term, trunc, info = env.step(k, state, a, params)
        acc = (CB.block_accounting(state.cluster, params.gpus)
               if state.cluster.pc is not None else {})
        audit = (CB.prefix_audit(state.cluster, params.gpus)
                 if state.cluster.pc is not None else jnp.ones((env.num_replicas,), bool))
        return state, (obs, r, term, trunc, info, acc, audit)

    keys = jax.random.split(key, actions.shape[0])
    return jax.lax.scan(step, state, (keys, actions))


run = jax.jit(rollout, static_argnums=(0,))
ACTIONS = jnp.asarray(np.random.default_rng(0).integers(0, 2, STEPS), jnp.int32)


# ------------------------------------------------------------------------------ environment

def test_default_scenario():
    """The registered defaults: the system_prompts workload, ranked replicas, no shaping
    (`make_llm_prefix_routing`'s docstring gives the reasons)."""
    assert "LLMPrefixRouting-v0" in jaxserve.registered_envs()
    env, params = jaxserve.make("LLMPrefixRouting-v0")
    assert env.ranked and env.shaping_gamma is None
    assert env == make_llm_prefix_routing()[0]
    assert env.name == "LLMPrefixRouting-v0" and env.policy_kind == "prefix_routing"
    assert isinstance(params, PrefixRoutingParams)
    assert env.num_replicas == 4 and env.prefix_blocks == 79 and env.max_seqs == 16
    assert env.obs_layout == (3, 4, 9)
    assert env.observation_space(params).shape == (3 + 4 * 9,)
    assert int(params.trace.length) == 512 and int(params.max_steps_in_episode) == 512
    assert np.asarray(params.gpus.block_size).tolist() == [128] * 4
    # the default workload shares prefixes: some requests sit below the tree's first level
    depth = np.asarray(params.tables.depth)[np.maximum(np.asarray(params.node), 0)]
    assert (depth > 1).mean() > 0.5
    plain, _ = jaxserve.make("LLMRouting-v0")
    assert plain.name == "LLMRouting-v0" and plain.policy_kind == "llm_routing"
    assert plain.prefix_blocks == 0


def test_prefix_info_block_conservation_and_audit_every_step():
    """The prefix-caching specifics of one rollout (the gymnax contract itself, step outputs,
    spaces and vmap, is tests/test_env_contract.py's): the observation's rows and the prefix
    counters in `info`; the trace's end terminates (the step drains) and auto-resets; and
    fresh + cached_unreferenced + held = kv_blocks after every step, the pool passing
    `prefix_audit` (reference counts rebuilt from the block tables, etc.)."""
    env, params = small()
    obs0, _ = env.reset(jax.random.PRNGKey(0), params)
    assert obs0.shape == (3 + 2 * 9,) and env.observation_space(params).contains(obs0)
    state, (obs, rew, term, trunc, info, acc, audit) = run(env, params, jax.random.PRNGKey(0),
                                                           ACTIONS)
    # The trace ends after N decisions: terminated there (the step drains), then auto-reset.
    assert np.flatnonzero(np.asarray(term)).tolist() == [N - 1]
    assert int(state.time) == STEPS - N
    for k in CB.PREFIX_EXTRAS:
        assert k in info and info[k].dtype == jnp.int32
    hit, look = int(info["prefix_hit_tokens"].sum()), int(info["prefix_lookup_tokens"].sum())
    assert 0 < hit < look  # prefixes are hit, and not every token
    assert int(info["prefix_evictions"].sum()) > 0
    # the prefix features: fractions in [0, 1], the hit fraction positive somewhere
    rows = np.asarray(obs)[:, 3:].reshape(STEPS, 2, 9)
    assert rows[:, :, 7:].min() >= 0.0 and rows[:, :, 7:].max() <= 1.0
    assert rows[:, :, 7].max() > 0.0 and rows[:, :, 8].max() > 0.0
    total = acc["fresh"] + acc["cached_unreferenced"] + acc["held"]
    np.testing.assert_array_equal(total, np.broadcast_to(np.asarray(params.gpus.kv_blocks),
                                                         total.shape))
    assert bool(np.asarray(audit).all())
    assert int(np.asarray(acc["cached_unreferenced"]).max()) > 0


@functools.partial(jax.jit, static_argnums=(0,))
def logged_episode(env, params, keys, actions, to_idle):
    """One episode of the trace (N decisions, no auto-reset) on `env` with a request log,
    from `reset_env(PRNGKey(0))`, step i keyed `keys[i]`: action i is `actions[i]`, or where
    `to_idle`, the first idle replica (i % 2 when none is). Per step, before it: the cached
    prefix blocks of the pending prompt on each replica, which replicas are idle, the prompt
    and the action; after it: termination and the drop. The tests of the log share this one
    compiled program."""
    _, state = env.reset_env(jax.random.PRNGKey(0), params)

    def f(state, x):
        i, k, a = x
        hit = pending_cached_blocks(state, params)
        idle = (state.cluster.queues.count + state.cluster.run.count) == 0
        a = jnp.where(to_idle, jnp.where(idle.any(), jnp.argmax(idle), i % 2), a)
        prompt = state.pending.prompt
        _, state, _, term, info = env.step_env(k, state, a.astype(jnp.int32), params)
        return state, (hit, idle, prompt, a, term, info["dropped"])

    return jax.lax.scan(f, state, (jnp.arange(N), keys, actions))


def test_observed_hit_equals_engine_lookup_at_admission():
    """The hit-fraction feature is what the engine then hits: routed to an idle replica, the
    request's cached tokens at admission (`log.cached_first`) equal the feature's
    `cached_prefix_blocks * block_size` whenever that is below the prompt (the admission
    cap `floor((L - 1) / b)` only binds for a fully shared prompt). Checked on the first 12
    decisions."""
    env, params = small()
    env_l = with_static(env, log_capacity=N)
    keys = jnp.stack([jax.random.PRNGKey(i) for i in range(N)])
    state, (hit, idle, prompt, a, _, _) = logged_episode(env_l, params, keys, ACTIONS[:N],
                                                         jnp.bool_(True))
    hits = np.asarray(hit) * 16
    idle, prompt, a = np.asarray(idle), np.asarray(prompt), np.asarray(a)
    first = np.asarray(state.log.cached_first)
    seen = 0
    for i in range(12):
        if idle[i].any() and hits[i, a[i]] < prompt[i]:
            assert first[i] == hits[i, a[i]], i
            seen += hits[i, a[i]] > 0
    assert seen > 0


def test_ten_times_load_finite():
    env, params = small()
    params = params.replace(trace=params.trace.replace(gap=params.trace.gap * 0.1))
    _, (obs, rew, term, trunc, info, acc, audit) = run(env, params, jax.random.PRNGKey(2),
                                                       ACTIONS)
    for leaf in jax.tree.leaves((obs, rew, info)):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    obs = np.asarray(obs)
    assert obs.min() >= 0.0 and obs.max() <= FEATURE_CLIP
    assert bool(np.asarray(audit).all())
    assert int(info["dropped"].sum()) + int(info["preemptions"].sum()) > 0  # overloaded


def _plain_twin():
    """LLMRouting-v0 on the same replicas, stream and scalars as `small()`."""
    env, params = small()
    kw = dict(tokens=params.tokens, estimate_mode=int(params.estimate_mode),
              estimate_noise=float(params.estimate_noise), slo_s=float(params.slo_s),
              max_steps_in_episode=int(params.max_steps_in_episode))
    return jaxserve.make("LLMRouting-v0", replicas=REPS, trace=PT.trace, **kw)


def test_caching_off_equals_llm_routing_exactly():
    env_off, p_off = small(caching=False)
    assert env_off.prefix_blocks == 0 and env_off.name == "LLMRouting-v0"
    env_p, p_p = _plain_twin()
    a = run(env_off, p_off, jax.random.PRNGKey(3), ACTIONS)
    b = run(env_p, p_p, jax.random.PRNGKey(3), ACTIONS)
    chex.assert_trees_all_equal(a[1][:5], b[1][:5])


def test_caching_on_without_sharing_or_preemption_equals_llm_routing():
    """With every node -1 (nothing shared) and a light load (no preemption: a preempted
    request may rehit its own blocks, which plain LLMRouting-v0 does not model), the cached
    engine's latencies, drops and rewards equal LLMRouting-v0's on the same stream."""
    env, params = small()
    params = params.replace(node=jnp.full_like(params.node, -1),
                            trace=params.trace.replace(gap=params.trace.gap * 4.0))
    env_p, p_p = _plain_twin()
    p_p = p_p.replace(trace=p_p.trace.replace(gap=p_p.trace.gap * 4.0))
    _, (o1, r1, t1, _, i1, _, _) = run(env, params, jax.random.PRNGKey(4), ACTIONS)
    _, (o2, r2, t2, _, i2, _, _) = run(env_p, p_p, jax.random.PRNGKey(4), ACTIONS)
    assert int(i1["preemptions"].sum()) == 0 and int(i1["prefix_hit_tokens"].sum()) == 0
    np.testing.assert_array_equal(t1, t2)
    for k in ("dropped", "completed", "first_tokens", "preemptions"):
        np.testing.assert_array_equal(i1[k], i2[k], err_msg=k)
    for k in ("in_system_time", "ttft_sum"):
        np.testing.assert_allclose(i1[k], i2[k], rtol=1e-5, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(r1, r2, rtol=1e-5, atol=1e-7)
    # the shared features are the same; the prefix ones are 0 (hit) without sharing
    rows = np.asarray(o1)[:, 3:].reshape(STEPS, 2, 9)
    np.testing.assert_allclose(rows[:, :, :7], np.asarray(o2)[:, 3:].reshape(STEPS, 2, 7),
                               rtol=1e-5, atol=1e-6)
    assert rows[:, :, 7].max() == 0.0


def test_replayed_cached_tokens_equal_replay_prefix():
    """Stepping the environment through the whole trace with fixed actions gives every
    request the cached tokens (first admission and summed over readmissions) that
    `jaxserve.replay_prefix` computes for the same routing."""
    env, params = small()
    env_l = with_static(env, log_capacity=N)
    acts = ACTIONS[:N]
    state, (*_, term, dropped) = logged_episode(
        env_l, params, jax.random.split(jax.random.PRNGKey(5), N), acts, jnp.bool_(False))
    assert bool(term[-1]) and not bool(term[:-1].any())
    ref = jaxserve.replay_prefix(REPS, PT, np.asarray(acts), queue_buffer=4)
    np.testing.assert_array_equal(np.asarray(dropped), ref["dropped"])
    got = np.maximum(np.asarray(state.log.cached_first), 0)
    np.testing.assert_array_equal(got, ref["cached_tokens"])
    np.testing.assert_array_equal(np.asarray(state.log.cached_total), ref["cached_tokens_total"])
    assert ref["cached_tokens"].sum() > 0 and (ref["cached_tokens_total"]
                                               > ref["cached_tokens"]).any()  # readmissions
    np.testing.assert_allclose(np.asarray(state.log.e2e), ref["finish"] - ref["arrival"],
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bad, field", [
    (dict(trace=PT.trace), "PrefixTrace"),
    (dict(reward="slo"), "log_capacity"),
    (dict(arrival_rate=3.0), "arrival_rate"),
    (dict(trace=PT.replace(node=PT.node[:-1])), "PrefixTrace.node"),
    (dict(replicas=[REPS[0].replace(block_size=48)] * 2), "block_size"),
])
def test_bad_config_raises_naming_field(bad, field):
    with pytest.raises(ValueError, match=field):
        small(**bad)


def test_bad_params_raise_naming_field():
    env, params = small()
    with pytest.raises(ValueError, match="replay_prefix"):
        jaxserve.replay(env, params, PT.trace, actions=np.zeros(N, np.int64))
    with pytest.raises(ValueError, match="params.node"):
        env.check_params(params.replace(node=params.node.at[0].set(10 ** 6)))
    with pytest.raises(ValueError, match="prefix_blocks"):
        env.check_params(params.replace(gpus=params.gpus.replace(
            kv_blocks=params.gpus.kv_blocks + 1)))


# ------------------------------------------------------------------------------ heuristics
# Hand states: 4 replicas of 32 blocks x 16 tokens, a prefix tree that is one chain of four
# 64-token hash blocks (nodes 0 -> 1 -> 2 -> 3), and a pending 256-token prompt at node 3, so
# its 16 KV blocks are all shared and block j's identity is `(-1, j)` (node j // 4, offset
# j % 4). A replica "caches c blocks" when its blocks 0..c-1 carry identities 0..c-1, and
# "holds h blocks" when blocks 0..h-1 have ref 1. Queues are wide (cap 128) so that no
# replica drops the request and SGLang's 64-request imbalance can be built.

HAND_REPS = [jaxserve.ReplicaProfile(kv_blocks=32, block_size=16, max_seqs=4, queue_cap=128)] * 4
HAND_PT = PrefixTrace(
    trace=jaxserve.Trace(np.array([0.0, 1.0]), np.array([256, 256]), np.array([8, 8])),
    node=np.array([3, -1]), full_blocks=np.array([4, 4]),
    tree=PrefixTree(parent=np.array([-1, 0, 1, 2]), depth=np.array([1, 2, 3, 4]),
                    hash_id=np.arange(4), block_tokens=64))


@pytest.fixture(scope="module")
def hand():
    env, params = make_llm_prefix_routing(replicas=HAND_REPS, trace=HAND_PT, ranked=False)
    _, state = env.reset(jax.random.PRNGKey(0), params)
    return env, params, state


def hand_state(state, cached, held, waiting, running, row=0):
    """`state` with per-replica cached prefix blocks, held blocks, waiting and running
    counts as given, the pending request being trace row `row`."""
    c = state.cluster
    m = c.pc.ref.shape[-1]
    j = np.arange(m)[None, :]
    cached, held = np.asarray(cached)[:, None], np.asarray(held)[:, None]
    pc = c.pc.replace(cached=jnp.asarray(j < cached), owner=jnp.full((4, m), -1, jnp.int32),
                      code=jnp.asarray(np.broadcast_to(j, (4, m)), jnp.int32),
                      born=jnp.asarray(np.broadcast_to(j, (4, m)), jnp.int32),
                      ref=jnp.asarray(j < held, jnp.int32))
    c = c.replace(pc=pc, queues=c.queues.replace(count=jnp.asarray(waiting, jnp.int32)),
                  run=c.run.replace(count=jnp.asarray(running, jnp.int32)))
    return state.replace(cluster=c, trace_pos=jnp.int32(row))


def act(name, state, params):
    return int(P.get(name)(jax.random.PRNGKey(0), None, state, params))


def test_hand_llmd_and_dynamo(hand):
    env, params, s0 = hand
    st = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[0, 2, 1, 3],
                    running=[1, 1, 1, 1])
    np.testing.assert_array_equal(pending_cached_blocks(st, params), [8, 4, 0, 12])
    # llm-d: queue (3 - q) / 3 = [1, 1/3, 2/3, 0]; kv 1 - held / 32 = [.75, .9375, 1, .25];
    # prefix cached / 16 = [.5, .25, 0, .75]; 2 q + 2 kv + 3 p = [5.0, 3.29, 3.33, 2.75].
    assert act("llmd_scorers", st, params) == 0
    # Dynamo: (16 - cached) + held = [16, 14, 16, 28].
    assert act("dynamo_kv", st, params) == 1
    # With equal waiting counts the queue scorer gives 1 everywhere: [5, 4.625, 4, 4.75].
    st2 = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[2, 2, 2, 2],
                     running=[1, 1, 1, 1])
    assert act("llmd_scorers", st2, params) == 0
    # A fuller replica 0 (held 30: kv .0625) drops to 3.625; replica 3 (4.75) wins.
    st3 = hand_state(s0, cached=[8, 4, 0, 12], held=[30, 2, 0, 24], waiting=[2, 2, 2, 2],
                     running=[1, 1, 1, 1])
    assert act("llmd_scorers", st3, params) == 3
    # Other weights (queue, kv, prefix) over the same scorers: each scorer alone, and the
    # default triple, which is llmd_scorers.
    key = jax.random.PRNGKey(0)
    # (0, 1, 2): kv + 2 prefix = [1.75, 1.4375, 1, 1.75], a tie (exact in float32): index 0.
    for w, want in (((1, 0, 0), 0), ((0, 1, 0), 2), ((0, 0, 1), 3), (PR.LLMD_DEFAULT, 0),
                    ((0, 1, 2), 0), ((0, 1, 2.5), 3)):
        assert int(PR.llmd_weighted(w)(key, None, st, params)) == want, w


def test_hand_sglang(hand):
    env, params, s0 = hand
    # Balanced (max - min = 3): the longest match 12 / 16 = .75 > .3 wins.
    st = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[0, 2, 1, 3],
                    running=[1, 1, 1, 1])
    assert act("sglang_cache_aware", st, params) == 3
    # Best match 4 / 16 = .25 <= .3: the most free blocks (32 - held = [24, 30, 32, 8]).
    st = hand_state(s0, cached=[4, 0, 0, 4], held=[8, 2, 0, 24], waiting=[0, 2, 1, 3],
                    running=[1, 1, 1, 1])
    assert act("sglang_cache_aware", st, params) == 2
    # Loads [71, 4, 6, 8]: 67 > 64 and 71 > 1.5 * 4: the least loaded, whatever is cached.
    st = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[70, 3, 5, 7],
                    running=[1, 1, 1, 1])
    assert act("sglang_cache_aware", st, params) == 1
    # Loads [61, 4, 6, 8]: 57 <= 64, balanced by SGLang's rule: the longest match.
    st = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[60, 3, 5, 7],
                    running=[1, 1, 1, 1])
    assert act("sglang_cache_aware", st, params) == 3
    # Other thresholds (cache, balance abs, balance rel), each in sglang_route's order:
    # abs 56 < 57 makes the same loads imbalanced (least loaded); rel 20 (61 <= 20 * 4) keeps
    # them balanced; cache 0.8 > .75 falls through to the most free blocks ([24, 30, 32, 8]).
    key = jax.random.PRNGKey(0)
    for th, want in ((PR.SGLANG_DEFAULT, 3), ((0.3, 56, 1.5), 1), ((0.3, 56, 20), 3),
                     ((0.8, 64, 1.5), 2), ((0.7, 64, 1.5), 3)):
        assert int(PR.sglang_thresholds(th)(key, None, st, params)) == want, th
    for bad in ((0.3, 64), (0.3, -1.0, 1.5), (float("nan"), 64, 1.5)):
        with pytest.raises(ValueError, match="SGLang thresholds"):
            PR.sglang_thresholds(bad)


def test_hand_aibrix(hand):
    env, params, s0 = hand
    # Loads [2, 3, 1, 9]: max - min = 8, not > 8. mean 3.75, std 3.11: replica 3 (9 > 6.86)
    # is skipped despite the longest match; next longest is replica 0 (8 blocks).
    st = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[1, 2, 0, 8],
                    running=[1, 1, 1, 1])
    assert act("aibrix_prefix_cache", st, params) == 0
    # Loads [2, 3, 1, 4] (mean 2.5, std 1.12, thr 3.62): replica 3 (4) is skipped again.
    st = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[1, 2, 0, 2],
                    running=[1, 1, 1, 2])
    assert act("aibrix_prefix_cache", st, params) == 0
    # Loads [2, 3, 1, 3] (mean 2.25, std .83, thr 3.08): replica 3 is within: longest match.
    st = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[1, 2, 0, 2],
                    running=[1, 1, 1, 1])
    assert act("aibrix_prefix_cache", st, params) == 3
    # Loads [2, 3, 1, 10]: 9 > 8, imbalanced: least request (replica 2).
    st = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[1, 2, 0, 9],
                    running=[1, 1, 1, 1])
    assert act("aibrix_prefix_cache", st, params) == 2
    # Nothing cached anywhere: least request.
    st = hand_state(s0, cached=[0, 0, 0, 0], held=[8, 2, 0, 24], waiting=[1, 2, 0, 2],
                    running=[1, 1, 1, 1])
    assert act("aibrix_prefix_cache", st, params) == 2
    # Other thresholds (imbalance abs, std factor), in aibrix_route's order, on the loads
    # [2, 3, 1, 9] of the first case: abs 7 < 8 makes them imbalanced (least request: 2); a
    # factor of 2 (thr 9.98) keeps replica 3 and its longest match; 0.5 (thr 5.31) skips it.
    st = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[1, 2, 0, 8],
                    running=[1, 1, 1, 1])
    key = jax.random.PRNGKey(0)
    for th, want in ((PR.AIBRIX_DEFAULT, 0), ((7, 1), 2), ((8, 2), 3), ((8, 0.5), 0)):
        assert int(PR.aibrix_thresholds(th)(key, None, st, params)) == want, th
    for bad in ((8,), (8, 1, 1), (-1, 1), (8, float("inf"))):
        with pytest.raises(ValueError, match="AIBrix thresholds"):
            PR.aibrix_thresholds(bad)


def test_hand_cache_or_shed(hand):
    env, params, s0 = hand
    key = jax.random.PRNGKey(0)
    # Replica 3 holds the longest match (12 blocks) but its queue is full (128 of 128):
    # most_cached skips it (replica 0, 8 blocks); cache_or_shed sends the request there.
    st = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[1, 2, 0, 128],
                    running=[1, 1, 1, 1])
    assert bool(would_drop(st, params)[3])
    assert act("most_cached", st, params) == 0
    assert int(PR.cache_or_shed(key, None, st, params)) == 3
    # With room there both pick it; with nothing cached anywhere cache_or_shed is most_cached.
    st = hand_state(s0, cached=[8, 4, 0, 12], held=[8, 2, 0, 24], waiting=[1, 2, 0, 3],
                    running=[1, 1, 1, 1])
    assert act("most_cached", st, params) == 3 == int(PR.cache_or_shed(key, None, st, params))
    st = hand_state(s0, cached=[0, 0, 0, 0], held=[8, 2, 0, 24], waiting=[128, 2, 0, 3],
                    running=[1, 1, 1, 1])
    assert int(PR.cache_or_shed(key, None, st, params)) == act("most_cached", st, params) != 0


def _mix32_np(x):
    x = np.uint64(x) & np.uint64(0xFFFFFFFF)
    m = np.uint64(0xFFFFFFFF)
    x = ((x ^ (x >> np.uint64(16))) * np.uint64(0x85EBCA6B)) & m
    x = ((x ^ (x >> np.uint64(13))) * np.uint64(0xC2B2AE35)) & m
    return x ^ (x >> np.uint64(16))


def _ring_np(key_hash, n):
    pts = sorted((int(_mix32_np((int(_mix32_np(r * 1000003 + v)) + 0x9E3779B9) & 0xFFFFFFFF)), r)
                 for r in range(n) for v in range(PR.RING_POINTS))
    for p, r in pts:
        if p >= key_hash:
            return r
    return pts[0][1]


def test_hand_session_affinity(hand):
    env, params, s0 = hand
    # The request's root node is 0 (parent chain 3 -> 2 -> 1 -> 0); its ring replica is the
    # owner of the first ring point at or after hash(0), computed here independently.
    assert int(PR.root_node(params.tables, jnp.int32(3))) == 0
    want = _ring_np(int(_mix32_np(0)), 4)
    for loads in ([0, 0, 0, 0], [3, 0, 5, 1], [1, 4, 2, 0]):
        st = hand_state(s0, cached=[0, 0, 0, 0], held=[0, 0, 0, 0], waiting=loads,
                        running=[0, 0, 0, 0])
        assert act("session_affinity", st, params) == want  # sticky whatever the load
    for key in (1, 7, 12345, 2 ** 31):
        assert int(PR.ring_replica(PR._mix32(jnp.uint32(key)), 4)) == _ring_np(
            int(_mix32_np(key)), 4)
    # No prefix node (row 1): the fewest requests.
    st = hand_state(s0, cached=[0, 0, 0, 0], held=[0, 0, 0, 0], waiting=[3, 0, 5, 1],
                    running=[1, 1, 0, 1], row=1)
    assert act("session_affinity", st, params) == 1


def test_heuristics_in_env_never_read_output_lengths():
    """Every registered prefix router drives the environment under jit (finite rewards) and
    picks the same replicas when the true output lengths of the pending, waiting and
    running requests are scrambled (estimates are a router's to read; these use none).
    Two compiled programs: the episode (fixed actions, or a router's), and every router's
    choices in the visited states."""
    env, params = small()
    drive = P.get("dynamo_kv")

    @jax.jit
    def episode(use_router):
        """`STEPS` steps from a reset with `ACTIONS`, or where `use_router` dynamo_kv's
        choices: the state before each step and the step's reward."""
        obs, state = env.reset(jax.random.PRNGKey(0), params)

        def f(c, x):
            obs, state = c
            k, a = x
            a = jnp.where(use_router, drive(k, obs, state, params), a)
            obs2, nxt, r, *_ = env.step(k, state, a, params)
            return (obs2, nxt), (state, r)

        return jax.lax.scan(f, (obs, state), (jax.random.split(jax.random.PRNGKey(0), STEPS),
                                              ACTIONS))[1]

    sts, _ = episode(jnp.bool_(False))

    @jax.jit
    @jax.vmap
    def scramble(st, k):
        k1, k2, k3 = jax.random.split(k, 3)
        c = st.cluster
        rnd = lambda kk, x: jax.random.randint(kk, x.shape, 1, 5000).astype(x.dtype)  # noqa
        c = c.replace(queues=c.queues.replace(output=rnd(k1, c.queues.output)),
                      run=c.run.replace(output=rnd(k2, c.run.output)))
        return st.replace(cluster=c, pending=st.pending.replace(
            output=rnd(k3, st.pending.output)))

    scr = scramble(sts, jax.random.split(jax.random.PRNGKey(9), STEPS))
    # The registered routers, and the fitted families (prefix_study's llmd_tuned,
    # guarded_tuned), which read no more.
    routers = {name: P.get(name) for name in P.names("prefix_routing")}
    routers.update({"llmd_weighted(1, 0, 2)": PR.llmd_weighted((1.0, 0.0, 2.0)),
                    "cache_guarded(0.5)": PR.cache_guarded(0.5),
                    "cache_guarded(1.5)": PR.cache_guarded(1.5)})
    route = lambda fn, s: fn(jax.random.PRNGKey(0), None, s, params)  # noqa: E731

    @jax.jit
    def choices(sts):
        """Every router's choice in each state; and the load guard by its definition:
        most_cached unless that replica holds > 0.5 x the mean tokens in flight, then
        jsq_tokens (and whether the guard fired)."""
        each = jnp.stack([jax.vmap(lambda s: route(fn, s))(sts) for fn in routers.values()])

        def by_definition(s):
            mc = route(PR.most_cached, s)
            load = CB.tokens_in_flight(s.cluster)
            over = load[mc] > 0.5 * jnp.maximum(load.mean(), 1.0)
            return jnp.where(over, route(jsq_tokens, s), mc), over

        return each, jax.vmap(by_definition)(sts)

    (a, (want, over)), (b, _) = choices(sts), choices(scr)
    a, b = np.asarray(a), np.asarray(b)
    for j, name in enumerate(routers):
        np.testing.assert_array_equal(a[j], b[j], err_msg=name)
        assert set(a[j].tolist()) <= {0, 1}, name
    np.testing.assert_array_equal(a[list(routers).index("cache_guarded(0.5)")],
                                  np.asarray(want))
    assert 0 < int(np.asarray(over).sum()) < STEPS  # both branches are taken
    # and one of them drives the episode (past the trace's end and the reset)
    assert np.all(np.isfinite(np.asarray(episode(jnp.bool_(True))[1])))


MOONCAKE = find_trace("mooncake_conversation")


@pytest.mark.skipif(MOONCAKE is None, reason="Mooncake trace not available (set "
                    "JAXSERVE_TRACES_DIR or run `jaxserve-traces fetch mooncake_conversation`)")
def test_mooncake_path_builds_params():
    """`trace=` a Mooncake file: one param row and one prefix node per request, the tree's
    512-token blocks, and the request features' scale covering its longest prompt."""
    env, params = make_llm_prefix_routing(trace=str(MOONCAKE))
    n = int(params.trace.length)
    assert n == 12031 and params.node.shape == (n,) and int(params.max_steps_in_episode) == n
    assert params.tables.block_tokens == 512 and params.tables.parent.shape[0] == 182_790
    assert float(params.tokens.max_prompt) >= float(params.trace.prompt.max())


def test_system_prompts_scenario_rewards_cache_affinity():
    """The `system_prompts` workload exists to pose the affinity trade-off: on its trace
    (512 requests, generator seed 0, one key) llm-d's prefix-aware scorers spend under 60% of
    JSQ-by-tokens' mean time in system (measured 10.9 s vs 27.5 s, hit rate 0.70 vs 0.41;
    `scripts.prefix_routers`-style episode, as `tests.prefix_learnability.episode_metrics`
    runs it: here both routers in one program, vmapped over the router). Deterministic: one
    fixed trace and key, so the margin (0.40 measured against the 0.6 bound) is the
    tolerance."""
    env, params = make_llm_prefix_routing(scenario="system_prompts", ranked=False,
                                          shaping_gamma=DEFAULT_SHAPING_GAMMA)
    routers = (PR.llmd_scorers, jsq_tokens)
    n = 512

    @jax.jit
    @jax.vmap
    def episode(i):
        obs, state = env.reset(jax.random.PRNGKey(0), params)

        def f(c, k):
            obs, state = c
            a = jax.lax.switch(i, routers, k, obs, state, params)
            obs, state, _, _, info = env.step_env(k, state, a, params)
            return (obs, state), (info["in_system_time"], info["prefix_hit_tokens"],
                                  info["prefix_lookup_tokens"])

        keys = jax.random.split(jax.random.PRNGKey(1), n)
        return jax.tree.map(lambda x: x.sum(), jax.lax.scan(f, (obs, state), keys)[1])

    tis, hit, look = (np.asarray(x, np.float64) for x in episode(jnp.arange(2)))
    time_in_system, hit_rate = tis / n, hit / np.maximum(look, 1.0)
    assert hit_rate[0] > hit_rate[1] + 0.2, hit_rate
    assert time_in_system[0] < 0.6 * time_in_system[1], time_in_system
    with pytest.raises(ValueError, match="scenario"):
        make_llm_prefix_routing(scenario="nope")


def test_ranked_replicas_reorder_actions_and_rows_only():
    """`ranked=True` changes what an action and an observation row name, not the dynamics:
    driven by the same replica choices (each turned into its rank by `replica_policy`, as a
    registered router is on the ranked registered env),
    the ranked environment's states, rewards and infos equal the index-ordered one's, its
    rows are the same rows in `replica_order`, and that order puts the replicas with the
    most cached blocks of the pending prompt first."""
    reps = [REPS[0]] * 3
    env, params = small(replicas=reps)
    renv, _ = small(replicas=reps, ranked=True)
    assert renv.ranked and not env.ranked
    router = PR.session_affinity
    assert env.replica_policy(router) is router  # index order: the router itself
    choice = jax.random.randint(jax.random.PRNGKey(5), (STEPS,), 0, 3)

    @jax.jit
    def go(key):
        _, s = env.reset(key, params)
        _, rs = renv.reset(key, params)

        def step(c, x):
            s, rs = c
            k, r = x
            a = renv.replica_policy(lambda k, o, s, p: r)(k, None, rs, params)
            picked = renv.replica_order(rs, params)[a]
            o, s, rew, _, _, info = env.step(k, s, r, params)
            ro, rs, rrew, _, _, rinfo = renv.step(k, rs, a, params)
            order = renv.replica_order(rs, params)
            hit = pending_cached_blocks(rs, params)
            return (s, rs), (picked, o, ro, rew, rrew, info, rinfo, order, hit)

        return jax.lax.scan(step, (s, rs), (jax.random.split(key, STEPS), choice))

    (s, rs), (picked, o, ro, rew, rrew, info, rinfo, order, hit) = go(jax.random.PRNGKey(6))
    np.testing.assert_array_equal(picked, choice)
    chex.assert_trees_all_equal(s, rs)
    drop_obs = lambda i: {k: v for k, v in i.items() if k != "final_observation"}  # noqa: E731
    chex.assert_trees_all_equal((rew, drop_obs(info)), (rrew, drop_obs(rinfo)))
    rows = np.asarray(o)[:, 3:].reshape(STEPS, 3, -1)
    order = np.asarray(order)
    np.testing.assert_array_equal(np.sort(order, -1), np.tile(np.arange(3), (STEPS, 1)))
    np.testing.assert_array_equal(np.asarray(ro)[:, 3:].reshape(STEPS, 3, -1),
                                  np.take_along_axis(rows, order[:, :, None], 1))
    np.testing.assert_array_equal(np.asarray(ro)[:, :3], np.asarray(o)[:, :3])
    ranked_hit = np.take_along_axis(np.asarray(hit), order, 1)
    assert np.all(np.diff(ranked_hit, axis=1) <= 0)
    assert (order != np.arange(3)).any(1).sum() > STEPS // 4  # the ranking is exercised


def test_ranked_router_replays_a_ranked_policy_in_index_order():
    """`prefix_study.ranked_router` (how experiment (p) runs a policy trained on the ranked
    environment in the routers' index-ordered program) routes as the policy does on the
    ranked environment: same states, rewards and infos. With the constant policy "rank 0"
    it is the `most_cached` baseline wherever no replica would drop the request."""
    reps = [REPS[0]] * 3
    env, params = small(replicas=reps)
    renv, _ = small(replicas=reps, ranked=True)
    obs0, _ = env.reset(jax.random.PRNGKey(0), params)
    w = jax.random.normal(jax.random.PRNGKey(7), (obs0.shape[0], 3))
    policy = lambda k, o: jnp.argmax(o @ w).astype(jnp.int32)  # noqa: E731
    router = ranked_router(env, policy)
    rank0 = ranked_router(env, lambda k, o: jnp.int32(0))

    @jax.jit
    def go(key):
        o, s = env.reset(key, params)
        ro, rs = renv.reset(key, params)

        def step(c, k):
            o, s, ro, rs = c
            r = router(k, o, s, params)
            first = rank0(k, o, s, params)
            mc = PR.most_cached(k, o, s, params)
            full = would_drop(s, params).any()
            o, s, rew, _, _, info = env.step(k, s, r, params)
            ro, rs, rrew, _, _, rinfo = renv.step(k, rs, policy(k, ro), params)
            return (o, s, ro, rs), (rew, rrew, info, rinfo, first, mc, full, r)

        return jax.lax.scan(step, (o, s, ro, rs), jax.random.split(key, STEPS))

    (_, s, _, rs), (rew, rrew, info, rinfo, first, mc, full, r) = go(jax.random.PRNGKey(6))
    chex.assert_trees_all_equal(s, rs)
    drop_obs = lambda i: {k: v for k, v in i.items() if k != "final_observation"}  # noqa: E731
    chex.assert_trees_all_equal((rew, drop_obs(info)), (rrew, drop_obs(rinfo)))
    assert len(np.unique(np.asarray(r))) == 3  # the policy routes to every replica
    open_ = ~np.asarray(full)
    assert open_.sum() > STEPS // 2
    np.testing.assert_array_equal(np.asarray(first)[open_], np.asarray(mc)[open_])
