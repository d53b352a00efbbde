"""Honest evaluation: no true-size information reaches observations or non-oracle heuristics,
tuning never shares streams with evaluation, paired CIs and the drop-inclusive metric."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import t as student_t

import jaxserve
from jaxserve import policies as P
from jaxserve.core.profiles import get_profile
from jaxserve.core.types import Trace
from jaxserve.core import sources
from jaxserve.core import stats
import importlib

E = importlib.import_module("jaxserve.evaluation.evaluate")  # the module, not the function


# ----------------------------------------------------------------------------- no size leaks

def _twin_states(num_requests=12):
    """Two Routing-v0 episodes whose requests have equal arrivals, prompts and output
    *estimates* (all in the long class) but different true outputs, routed identically;
    the observations and states after each routing decision, before any batch can finish."""
    arrivals = np.arange(num_requests) * 0.01  # batches take seconds: nothing completes
    prompt = np.full(num_requests, 512.0)
    rng = np.random.default_rng(0)
    out_a = rng.integers(200, 2000, num_requests).astype(float)
    out_b = rng.integers(200, 2000, num_requests).astype(float)
    # One decision fewer than requests: the last would end the trace and drain the cluster.
    actions = jnp.asarray(np.arange(num_requests - 1) % 4, jnp.int32)
    runs = []
    for out in (out_a, out_b):
        tr = Trace(arrival_s=arrivals, prompt_tokens=prompt, output_tokens=out)
        env, params = jaxserve.make("Routing-v0", trace=tr, estimate_mode=2)  # size class
        obs, state = env.reset(jax.random.PRNGKey(0), params)
        obss, states = [obs], [state]
        for i, a in enumerate(actions):
            obs, state, *_ = env.step(jax.random.PRNGKey(i + 1), state, a, params)
            obss.append(obs)
            states.append(state)
        runs.append((env, params, obss, states))
    return runs


def test_observation_invariant_to_true_output_lengths():
    (_, _, obs_a, st_a), (_, _, obs_b, st_b) = _twin_states()
    # The runs do differ in what is hidden: the running batches' true ends.
    assert not np.allclose(np.asarray(st_a[-1].cluster.servers.free_at),
                           np.asarray(st_b[-1].cluster.servers.free_at))
    assert int(st_a[-1].cluster.servers.run_count.sum()) > 0
    for a, b in zip(obs_a, obs_b):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_non_oracle_routing_policies_ignore_true_output_lengths():
    (env, params, obs_a, st_a), (_, params_b, obs_b, st_b) = _twin_states()
    names = [n for n in P.names("routing") if not n.endswith("_oracle")]
    assert {"sed", "least_work_left", "sita", "jsq"} <= set(names)
    oracles = [n for n in P.names("routing") if n.endswith("_oracle")]
    assert set(oracles) == {"sed_oracle", "least_work_left_oracle"}
    key = jax.random.PRNGKey(3)
    for n in names:
        small = {"num_envs": 2, "num_steps": 12, "warmup": 2}  # sita_tuned's simulated tuning
        pol = P.get(n, kind="routing", env=env, params=params,
                    **(small if "num_envs" in P.options(n, kind="routing") else {}))
        for oa, sa, ob, sb in zip(obs_a, st_a, obs_b, st_b):
            assert int(pol(key, oa, sa, params)) == int(pol(key, ob, sb, params_b)), n
    # The oracles do read the truth (so the twin states differ in what they could use).
    from jaxserve.policies.routing import _oracle_queued_work
    assert any(not np.allclose(np.asarray(_oracle_queued_work(sa, params)),
                               np.asarray(_oracle_queued_work(sb, params_b)))
               for sa, sb in zip(st_a, st_b))


def test_batching_observation_invariant_to_true_output_lengths():
    arrivals = np.array([0.0, 0.5, 0.6, 0.7])
    obs = []
    for out in ([300.0, 400.0, 500.0, 600.0], [1500.0, 250.0, 1900.0, 700.0]):
        tr = Trace(arrival_s=arrivals, prompt_tokens=np.full(4, 256.0),
                   output_tokens=np.asarray(out))
        env, params = jaxserve.make("Batching-v0", trace=tr)
        o, _ = env.reset(jax.random.PRNGKey(0), params)
        obs.append(np.asarray(o))
    np.testing.assert_array_equal(obs[0], obs[1])


# ----------------------------------------------------------------------------- tuning keys

def test_tuning_keys_never_evaluate():
    # The registry of tuning keys is per process: a key no other test tunes with.
    key = jax.random.PRNGKey(987_654)
    tk = sources.tuning_key(key)
    assert not np.array_equal(np.asarray(tk), np.asarray(key))
    assert sources.is_tuning_key(tk) and not sources.is_tuning_key(key)
    env, params = jaxserve.make("Routing-v0")
    with pytest.raises(ValueError, match="used to tune"):
        jaxserve.evaluate(env, params, P.get("jsq"), tk, num_envs=2, num_steps=10)
    # Tuning and evaluation streams share no request.
    ev, _ = E.make_streams(key, params, 4, 200, None)
    tu, _ = E.make_streams(tk, params, 4, 200, None)
    rows = lambda st: {tuple(r) for r in np.stack(  # noqa: E731
        [np.asarray(st.gap), np.asarray(st.prompt), np.asarray(st.output)], -1).reshape(-1, 3)}
    assert not rows(ev) & rows(tu)


def test_fitted_policies_mark_their_keys():
    env, params = jaxserve.make("Batching-v0", max_steps_in_episode=64)
    k = jax.random.PRNGKey(11)
    P.get("tuned_static", env=env, params=params, key=k, max_batches=[1, 4],
          timeouts=[0.0], num_envs=2, num_steps=30)
    with pytest.raises(ValueError, match="used to tune"):
        jaxserve.evaluate(env, params, P.get("greedy"), k, num_envs=2, num_steps=10)
    renv, rparams = jaxserve.make("Routing-v0")
    k2 = jax.random.PRNGKey(12)
    P.get("sita", params=rparams, key=k2, num_samples=256)
    assert sources.is_tuning_key(k2)
    # The defaults tune on tuning_key(PRNGKey(0)), so evaluating with PRNGKey(0) is allowed.
    P.get("sita", params=rparams, num_samples=256)
    assert not sources.is_tuning_key(jax.random.PRNGKey(0))


def test_split_trace_windows_are_disjoint():
    arr = np.cumsum(np.full(40, 0.5))
    tr = Trace(arrival_s=arr, prompt_tokens=np.arange(40) + 1.0,
               output_tokens=np.arange(40) + 100.0)
    fit, scored = sources.split_trace(tr, 0.25)
    assert len(fit) == 10 and len(scored) == 30
    assert set(fit.prompt_tokens).isdisjoint(set(scored.prompt_tokens))
    assert scored.arrival_s[0] == 0.0
    np.testing.assert_allclose(np.diff(scored.arrival_s), 0.5)
    with pytest.raises(ValueError):
        sources.split_trace(tr, 1.0)


# ----------------------------------------------------------------------------- statistics

def test_paired_difference_known_example():
    a = [1.0, 2.0, 3.0, 4.0]
    b = [0.0, 1.0, 1.0, 2.0]  # differences 1, 1, 2, 2
    d = stats.paired_difference(a, b)
    half = student_t.ppf(0.975, 3) * np.std([1, 1, 2, 2], ddof=1) / 2.0
    assert d["n"] == 4 and d["mean"] == pytest.approx(1.5)
    assert d["ci"] == pytest.approx(half) and d["ci"] == pytest.approx(0.9186, abs=1e-4)
    assert d["low"] == pytest.approx(1.5 - half) and d["significant"]
    # Pairing removes the between-replicate spread the unpaired CIs carry.
    assert d["ci"] < stats.t_halfwidth(a)
    same = stats.paired_difference([1.0, 5.0, 9.0], [1.5, 4.5, 9.0])
    assert not same["significant"]
    with pytest.raises(ValueError):
        stats.paired_difference([1.0, 2.0], [1.0])


def test_drop_inclusive_latency():
    gpus = [get_profile("slow", queue_cap=2)] * 2  # tiny queues: drops at this rate
    env, params = jaxserve.make("Routing-v0", gpus=gpus, arrival_rate=3.0)
    res = jaxserve.evaluate_many(env, params, {"jsq": P.get("jsq"), "rr": P.get("round_robin")},
                                 jax.random.PRNGKey(5), 3, 200)
    for r in res.values():
        assert r["dropped"] > 0
        measured = r["measured"]
        pen = float(params.drop_penalty_s)
        expect = (r["latencies"].sum() + pen * r["dropped"]) / measured
        assert r["mean_latency_incl_drops"] == pytest.approx(expect, rel=1e-9)
        assert r["mean_latency_incl_drops"] > r["mean_latency"]
    table = E.paired_table(res, "jsq")
    d = table["rr"]["mean_latency_incl_drops"]
    np.testing.assert_allclose(
        d["mean"], np.mean(res["rr"]["per_env"]["latency_incl_drops"]
                           - res["jsq"]["per_env"]["latency_incl_drops"]))
