"""LLMDisaggRouting-v0 (envs/llm_disagg_routing.py) and its routers (policies/disagg_routing.py).

One compiled program serves the contract checks: `LANES` environments, vmapped over keys and
params (arrival rate, episode length) and policies (a lane's policy is picked among all of
them by index, every policy being cheap next to the engine), stepped `T` times through
gymnax's auto-resetting `step`. The same program unbatched on lane 0 checks that vmap equals
single environments. Lane 0's episode (Dynamo's decider, JSQ per pool, never truncated) is
replayed by the pure-Python reference (`reference/disaggregation.py`) with the routes it took:
every request's first token, transfer start and end and finish must agree.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import policies as P
from jaxserve.core import arrivals as A
from jaxserve.core.replica import replica_profile
from jaxserve.envs import llm_disagg_routing as E
from jaxserve.policies import disagg_routing as R
from jaxserve.reference import continuous as cref
from jaxserve.reference.disaggregation import simulate

# One pytest-xdist worker for the whole file (`--dist loadgroup`): its tests share `batch()`.
pytestmark = pytest.mark.xdist_group("llm_disagg_routing")

T = 96  # steps per lane
POLICIES = ("dynamo_jsq", "always_jsq", "never_least_kv", "llmd_least_kv")
# lane: (policy index or -1 for the scripted actions, arrival-rate factor, max_steps)
LANES = ((0, 1.0, 512), (1, 10.0, 512), (2, 10.0, 512), (-1, 1.0, 5), (3, 1.0, 512))
# Scripted actions of lane 3: valid ones, then out of range, negative, fractional and NaN
# (floats: the action array is float32 so that NaN and 2.5 can be sent).
SCRIPT = np.array([0, 5, 3, -1, 99, 2.5, np.nan, 1] * (T // 8), np.float32)
BAD = {-1.0: 0, 99.0: 5, 2.5: 2}  # the invalid actions and the action each maps to


@functools.lru_cache(maxsize=1)
def scenario():
    return E.make_llm_disagg_routing()


def lane_params(params, rate, steps):
    base = float(params.arrivals.rates[0])
    return params.replace(arrivals=A.poisson(base * rate),
                          max_steps_in_episode=jnp.int32(steps))


def rollout(env, pol_idx, params, key):
    """`T` auto-resetting steps; returns per-step outputs and the final state."""
    pols = [P.get(n, kind="disagg_routing") for n in POLICIES]
    k_reset, k_steps = jax.random.split(key)
    obs, st = env.reset(k_reset, params)

    def body(c, i):
        obs, st = c
        k = jax.random.fold_in(k_steps, i)
        heur = jnp.stack([f(k, obs, st, params) for f in pols])[jnp.maximum(pol_idx, 0)]
        act = jnp.where(pol_idx >= 0, heur.astype(jnp.float32), jnp.asarray(SCRIPT)[i])
        req = st.pending
        obs2, st2, r, term, trunc, info = env.step(k, st, act, params)
        out = dict(obs=obs, act=act, reward=r, term=term, trunc=trunc, prompt=req.prompt,
                   output=req.output, time=st.time, **{k2: v for k2, v in info.items()
                                                        if k2 != "final_observation"})
        return (obs2, st2), out

    (obs, st), out = jax.lax.scan(body, (obs, st), jnp.arange(T))
    return out, st


@functools.lru_cache(maxsize=1)
def batch():
    env, params = scenario()
    lanes = [lane_params(params, r, s) for _, r, s in LANES]
    prm = jax.tree.map(lambda *x: jnp.stack(x), *lanes)
    idx = jnp.asarray([p for p, _, _ in LANES], jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(3), len(LANES))
    run = jax.jit(jax.vmap(functools.partial(rollout, env)))
    out, st = jax.device_get(run(idx, prm, keys))
    return out, st, keys, lanes


def test_spaces_shapes_and_contract():
    env, params = scenario()
    out, st, _, _ = batch()
    n_obs = E.NUM_REQUEST_FEATURES + 4 * E.NUM_REPLICA_FEATURES
    assert env.observation_space(params).shape == (n_obs,)
    assert env.action_space(params).n == 2 * 3 == env.num_actions
    assert out["obs"].shape == (len(LANES), T, n_obs) and out["obs"].dtype == np.float32
    assert out["reward"].shape == (len(LANES), T) and np.all(np.isfinite(out["reward"]))
    assert np.all(out["reward"] <= 0)
    assert not out["term"].any()  # synthetic arrivals never terminate
    # Every request arrives once and is completed, dropped, or still in the system.
    arrived = out["arrived"].sum(1)
    assert np.all(arrived == T)
    assert np.all(out["completed"].sum(1) + out["dropped"].sum(1) <= arrived)
    assert np.all(out["overflow"] == 0)
    # The pool flag: P rows first.
    rows = out["obs"][..., E.NUM_REQUEST_FEATURES:].reshape(len(LANES), T, 4, 4)
    assert np.all(rows[..., :2, 3] == 1) and np.all(rows[..., 2:, 3] == 0)


def test_auto_reset_on_truncation():
    out, _, _, _ = batch()
    lane = [i for i, (_, _, s) in enumerate(LANES) if s == 5][0]
    trunc, time = out["trunc"][lane], out["time"][lane]
    assert trunc.sum() >= T // 5  # horizons in [3, 5]
    after = np.flatnonzero(trunc)[:-1] + 1
    assert np.all(time[after] == 0)  # the step after a truncation starts a fresh episode
    lengths = np.diff(np.concatenate([[-1], np.flatnonzero(trunc)]))
    assert set(lengths) <= {3, 4, 5}
    others = [i for i, (_, _, s) in enumerate(LANES) if s > T]
    assert not out["trunc"][others].any()


def test_bad_actions_counted_and_mapped():
    out, _, _, _ = batch()
    lane = [i for i, (p, _, _) in enumerate(LANES) if p < 0][0]
    act, bad = out["act"][lane], out["invalid_actions"][lane]
    want = ~np.isin(act, np.arange(6, dtype=np.float32))
    assert np.array_equal(bad.astype(bool), want) and want.sum() == 4 * (T // 8)
    for a, mapped in {**BAD, np.nan: 0}.items():
        d, p, inv = E.decode_action(jnp.float32(a), 2, 2)
        assert bool(inv) and int(d) * 3 + int(p) + 1 == mapped
    d, p, inv = E.decode_action(jnp.int32(5), 2, 2)
    assert (int(d), int(p), bool(inv)) == (1, 1, False)
    d, p, inv = E.decode_action(jnp.int32(3), 2, 2)
    assert (int(d), int(p), bool(inv)) == (1, -1, False)
    assert int(E.encode_action(1, 1, 2)) == 5 and int(E.encode_action(0, -1, 2)) == 0


def test_features_finite_and_bounded_at_10x_load():
    out, _, _, _ = batch()
    hot = [i for i, (_, r, _) in enumerate(LANES) if r == 10.0]
    obs = out["obs"][hot]
    assert np.all(np.isfinite(obs)) and obs.min() >= 0
    # O(1): fractions, and waiting / queue_cap at most queue_buffer / queue_cap = 2.
    assert obs.max() <= 2.0
    # The load is real: queues built up (some replica's waiting over a tenth of its cap).
    rows = obs[..., E.NUM_REQUEST_FEATURES:].reshape(len(hot), T, 4, 4)
    assert rows[..., 1].max() > 0.1


def test_vmap_equals_single_env():
    env, _ = scenario()
    out, st, keys, lanes = batch()
    one = jax.jit(functools.partial(rollout, env))
    o1, s1 = jax.device_get(one(jnp.int32(LANES[0][0]), lanes[0], keys[0]))
    for k in ("obs", "reward", "act", "completed", "in_system_time", "transfers_started"):
        np.testing.assert_array_equal(o1[k], out[k][0], err_msg=k)
    np.testing.assert_array_equal(s1.log.requests.e2e, st.log.requests.e2e[0])


def test_heuristic_episode_equals_reference():
    """Lane 0 (Dynamo's decider with JSQ per pool, default load): per request, the
    reference driven by the routes the environment took gives the same times."""
    env, params = scenario()
    out, st, _, _ = batch()
    lane = 0
    act = out["act"][lane].astype(np.int64)
    d, p = act // 3, act % 3 - 1
    prompt = out["prompt"][lane].astype(np.int64)
    output = out["output"][lane].astype(np.int64)
    # Dynamo's rule at its default: remote prefill iff prompt > 1000 tokens.
    assert np.array_equal(p >= 0, prompt > R.DYNAMO_MAX_LOCAL_PREFILL_LENGTH)
    assert 0 < (p >= 0).sum() < T
    gaps = out["elapsed"][lane].astype(np.float64)
    arrival = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    end = arrival[-1] + gaps[-1]  # the episode's clock after its last step
    profs = cref_profiles(params)
    link = {k: float(getattr(params.link, k)) for k in ("bandwidth", "base_latency",
                                                        "kv_bytes_per_token")}
    link["shared"] = bool(params.link.shared)
    ref = simulate(arrival, prompt, output, profs[:2], profs[2:], p, d, link=link)
    log = st.log
    got = {"first_token": log.requests.ttft[lane, :T], "finish": log.requests.e2e[lane, :T],
           "transfer_start": log.transfer_start[lane, :T],
           "transfer_end": log.transfer_end[lane, :T]}
    assert not ref["dropped"].any() and not out["dropped"][lane].any()
    for k, g in got.items():
        r = ref[k] - arrival
        seen = ref[k] <= end - 1e-3  # happened within the episode (the rest: not yet)
        np.testing.assert_allclose(g[seen], r[seen], atol=1e-3, err_msg=k)
        assert np.all(~np.isfinite(g[np.isfinite(ref[k]) & (ref[k] > end + 1e-3)])), k
    assert np.isfinite(got["finish"]).sum() >= T // 2
    # Reward accounting: the summed time-in-system equals each request's time in the system
    # up to the episode's end.
    fin = np.where(np.isfinite(got["finish"]), arrival + got["finish"], end)
    np.testing.assert_allclose(out["in_system_time"][lane].sum(), (fin - arrival).sum(),
                               rtol=1e-4)
    np.testing.assert_allclose(out["latency_sum"][lane].sum(),
                               np.nansum(got["finish"]), rtol=1e-4)


def cref_profiles(params):
    g = jax.tree.map(np.asarray, params.gpus)
    keys = [k for k in cref.REPLICA_KEYS if k != "moe_tokens"]
    return [dict({k: getattr(g, k)[i].item() for k in keys}, moe_tokens=g.moe_tokens)
            for i in range(4)]


def test_registered_heuristics_each_once():
    names = P.names("disagg_routing")
    want = {f"{d}_{r}" for d in ("llmd", "dynamo", "always", "never")
            for r in ("jsq", "least_kv")} | {"disagg_round_robin"}
    assert set(names) == want
    assert R.LLMD_NON_CACHED_TOKENS == 16 and R.DYNAMO_MAX_LOCAL_PREFILL_LENGTH == 1000
    assert bool(R.llmd_decider(16)) and not bool(R.llmd_decider(15))
    assert bool(R.dynamo_decider(1001)) and not bool(R.dynamo_decider(1000))


def test_builder_refuses_bad_configuration():
    r = replica_profile("opt13b-a100-80g")
    with pytest.raises(ValueError, match="max_steps_in_episode"):
        E.make_llm_disagg_routing(num_requests=8)
    with pytest.raises(ValueError, match="decode"):
        E.make_llm_disagg_routing(decode=[])
    with pytest.raises(ValueError, match="prefill="):
        E.make_llm_disagg_routing(gpus=[r])
    with pytest.raises(ValueError, match="link"):
        E.make_llm_disagg_routing(link={"bandwidht": 1.0})
    with pytest.raises(ValueError, match="bandwidth"):
        E.make_llm_disagg_routing(link={"bandwidth": 0.0})
    with pytest.raises(ValueError, match="reward"):
        E.make_llm_disagg_routing(reward="goodput")
    with pytest.raises(ValueError, match="trace"):
        E.make_llm_disagg_routing(trace=object())
