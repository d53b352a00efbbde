"""Autoscaler evaluation harness and the jaxserve-autoscale CLI."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve import policies as P
from jaxserve.evaluation.scaling import evaluate_autoscalers, verdicts
from jaxserve.scripts import autoscale


def small(**kw):
    kw.setdefault("max_replicas", 3)
    kw.setdefault("max_steps_in_episode", 12)
    kw.setdefault("arrival_rate", 0.8)
    return jaxserve.make("Autoscaling-v0", **kw)


def test_fixed_counts_cost_exactly_and_share_arrivals():
    env, params = small()
    pols = {f"fixed-{n}": P.get("fixed", env=env, params=params, replicas=n) for n in (1, 2, 3)}
    pols["hpa"] = P.get("hpa", env=env, params=params)
    out = evaluate_autoscalers(env, params, pols, jax.random.key(0), num_envs=3)
    duration_h = 12 * float(params.control_interval_s) / 3600.0
    # Reset starts with initial_replicas=2 serving, so fixed counts hold from the first step.
    for n in (1, 2, 3):
        assert out[f"fixed-{n}"]["gpu_hours"] == pytest.approx(n * duration_h, rel=1e-5)
        assert out[f"fixed-{n}"]["mean_replicas"] == pytest.approx(n, rel=1e-5)
    # Common random numbers: every policy saw the same requests.
    assert len({r["arrived"] for r in out.values()}) == 1
    assert out["fixed-3"]["mean_latency"] <= out["fixed-1"]["mean_latency"]
    for r in out.values():
        assert all(np.isfinite(r[k]) for k in ("cost", "gpu_hours", "mean_latency", "return"))


def test_trace_episode_stops_at_its_end():
    times = np.arange(0.0, 60.0, 2.0)
    trace = jaxserve.Trace(arrival_s=times, prompt_tokens=np.full(times.size, 128),
                           output_tokens=np.full(times.size, 64))
    env, params = jaxserve.make("Autoscaling-v0", max_replicas=2, trace=trace)
    pols = {"fixed-1": P.get("fixed", env=env, params=params, replicas=1)}
    out = evaluate_autoscalers(env, params, pols, jax.random.key(1), num_envs=2, num_steps=40)
    r = out["fixed-1"]
    assert r["arrived"] == times.size and r["in_flight"] == 0
    assert 4 <= r["intervals"] < 40  # masked after the natural end
    assert r["gpu_hours"] == pytest.approx(r["intervals"] * 15.0 / 3600.0, rel=1e-5)


def test_bad_arguments():
    env, params = small()
    with pytest.raises(ValueError, match="policies"):
        evaluate_autoscalers(env, params, {}, jax.random.key(0))
    renv, rparams = jaxserve.make("Routing-v0")
    with pytest.raises(ValueError, match="Autoscaling-v0"):
        evaluate_autoscalers(renv, rparams, {"x": lambda *a: 0}, jax.random.key(0))


def test_verdicts_and_frontier():
    fixed = {"fixed-1": dict(gpu_hours=1.0, mean_latency=100.0, cost=50.0),
             "fixed-2": dict(gpu_hours=2.0, mean_latency=40.0, cost=60.0)}
    res = {**fixed, "hpa": dict(gpu_hours=2.0, mean_latency=45.0, cost=70.0),
           "agent": dict(gpu_hours=1.5, mean_latency=60.0, cost=45.0)}
    v = verdicts(res)
    assert v["agent"]["frontier_latency_s"] == pytest.approx(70.0)
    assert v["agent"]["below_fixed_frontier"] and v["agent"]["cheaper_than_every_fixed"]
    assert v["agent"]["cheaper_than_hpa"]
    assert not v["hpa"]["below_fixed_frontier"] and v["hpa"]["cheaper_than_hpa"] is None
    assert v["agent"]["beats_autoscalers"] is None  # no p99 measured
    # With p99: cheaper than every autoscaler present, at equal or better p99.
    p99 = {"hpa": 50.0, "knative": 80.0, "ray_serve": 55.0, "agent": 50.0}
    res = {**fixed, **{n: dict(gpu_hours=2.0, mean_latency=45.0, cost=70.0, p99_latency=p)
                       for n, p in p99.items() if n != "agent"},
           "agent": dict(gpu_hours=1.5, mean_latency=60.0, cost=45.0, p99_latency=50.0)}
    v = verdicts(res)["agent"]
    assert v["p99_le_hpa"] and v["cheaper_than_knative"] and v["beats_autoscalers"]
    res["agent"]["p99_latency"] = 50.5
    assert verdicts(res)["agent"]["beats_autoscalers"] is False


def test_told_price_choice_and_adapter():
    from types import SimpleNamespace

    from jaxserve.agents.autoscaling import as_evaluated, evaluation_overrides
    from jaxserve.evaluation.scaling import choose_told_price
    from jaxserve.policies.autoscaling import told_price

    res = {"hpa": dict(p99_latency=40.0), "ray_serve": dict(p99_latency=42.0),
           "a@1": dict(cost=90.0, p99_latency=30.0), "a@2": dict(cost=80.0, p99_latency=39.0),
           "a@4": dict(cost=70.0, p99_latency=45.0)}
    cands = {"a@1": 1.0, "a@2": 2.0, "a@4": 4.0}
    assert choose_told_price(res, cands) == (2.0, "a@2", True)  # cheapest with p99 <= 40
    res["a@1"]["p99_latency"] = res["a@2"]["p99_latency"] = 41.0
    assert choose_told_price(res, cands) == (1.0, "a@1", False)  # none: the lowest p99
    # The adapter: told price in the observation, target actions, a decision every k-th step.
    env, params = small()
    seen = []
    pol = told_price(lambda k, o, s, p: (seen.append(o), jnp.int32(2))[1], 3.0)
    i = env.FEATURES.index("price")
    obs, state = env.reset(jax.random.key(0), params)
    pol(None, obs, state, params)
    assert float(seen[0][i]) == pytest.approx(0.75) and float(obs[i]) == pytest.approx(0.8)
    run = SimpleNamespace(policy=lambda k, o, s, p: jnp.int32(2),  # step +1 in delta mode
                          env_params=params.replace(control_interval_s=jnp.float32(30.0),
                                                    action_mode=jnp.int32(1)),
                          env_overrides={"action_mode": 1, "gpu_price": 8.0, "workload": "x"})
    act = as_evaluated(run, params)
    assert int(act(None, obs, state, params)) == 2  # time 0: decides, +1 -> target 3 = action 2
    assert int(act(None, obs, state.replace(time=jnp.int32(1)), params)) == 1  # holds 2
    assert evaluation_overrides(run, {"workload": "diurnal"}) == {"gpu_price": 8.0,
                                                                  "workload": "diurnal"}


def test_cli_writes_results_and_plot(tmp_path, capsys):
    rc = autoscale.main(["--set", "max_replicas=2", "--set", "max_steps_in_episode=6",
                         "--num-envs", "2", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "autoscale.json").read_text())
    assert {"fixed-1", "fixed-2", "hpa", "knative", "ray_serve"} <= set(doc["results"])
    assert (tmp_path / "cost_latency.png").stat().st_size > 0
    assert "fixed-2" in capsys.readouterr().out
    assert autoscale.main(["--run", str(tmp_path / "nope")]) == 2
    assert "not a jaxserve-train run" in capsys.readouterr().err


def test_per_episode_metrics_pair_with_the_summary():
    env, params = small()
    pols = {"fixed-1": P.get("fixed", env=env, params=params, replicas=1),
            "fixed-3": P.get("fixed", env=env, params=params, replicas=3)}
    out, per = evaluate_autoscalers(env, params, pols, jax.random.key(0), num_envs=3,
                                    episodes=True)
    for n in pols:
        assert per[n]["cost"].shape == (3,)
        assert out[n]["cost"] == pytest.approx(per[n]["cost"].mean(), rel=1e-9)
    # Same episodes: the paired GPU-hour difference is exact, 2 replicas x duration.
    from jaxserve.core.stats import paired_difference
    d = paired_difference(per["fixed-3"]["gpu_hours"], per["fixed-1"]["gpu_hours"])
    assert d["mean"] == pytest.approx(2 * 12 * float(params.control_interval_s) / 3600, rel=1e-5)
    assert d["ci"] == pytest.approx(0.0, abs=1e-9)


def test_p99_is_exact_per_request_and_counts_drops():
    """One replica, greedy batcher, queue of one: a long request, a short one queued behind
    it, a third refused (queue full), then 17 short ones alone. Latencies by hand from
    `single_request_time`; p99 over the 19 served, and with the drop counted as inf."""
    from jaxserve.core.service import single_request_time
    from jaxserve.core.types import GPUProfile
    from jaxserve.evaluation.scaling import AUTOSCALERS, episode_totals

    gpu = GPUProfile(max_batch=1, queue_cap=1)
    times = np.r_[0.0, 1.0, 2.0, 30.0 + 30.0 * np.arange(17)]
    out_tok = np.r_[1000, 100, 100, np.full(17, 100)]
    trace = jaxserve.Trace(arrival_s=times, prompt_tokens=np.full(20, 100),
                           output_tokens=out_tok)
    env, params = jaxserve.make("Autoscaling-v0", gpus=[gpu], trace=trace, initial_replicas=1)
    long_s, short_s = (float(single_request_time(gpu, 100.0, o)) for o in (1000.0, 100.0))
    served = [long_s, long_s - 1.0 + short_s] + [short_s] * 17
    pols = {"fixed-1": P.get("fixed", env=env, params=params, replicas=1)}
    res, per = evaluate_autoscalers(env, params, pols, jax.random.key(0), num_envs=2,
                                    episodes=True)
    r = res["fixed-1"]
    assert r["dropped"] == 2 and r["in_flight"] == 0  # one drop in each of the 2 episodes
    np.testing.assert_allclose(per["fixed-1"]["p99_latency"], np.percentile(served, 99.0),
                               rtol=1e-5)
    assert r["p99_latency"] == pytest.approx(long_s + 0.82 * (short_s - 1.0), rel=1e-5)
    assert np.isposinf(per["fixed-1"]["p99_latency_drops"]).all()  # 1 of 20 dropped > 1%
    assert r["mean_latency"] == pytest.approx(np.mean(served), rel=1e-5)
    # The log itself: 19 exact latencies, one inf (the drop), NaN past the trace.
    lat = np.asarray(episode_totals(with_log(env, 32), pols["fixed-1"], params,
                                    jax.random.key(0), 120)["latency"])
    np.testing.assert_allclose(np.sort(lat[np.isfinite(lat)]), np.sort(served), rtol=1e-5)
    assert np.isposinf(lat[2]) and np.isnan(lat[20:]).all()
    # The training env keeps no log; p99 appears only in the evaluation's variant.
    assert env.log_capacity == 0 and "p99_latency" not in evaluate_autoscalers(
        env, params, pols, jax.random.key(0), num_envs=1, log_capacity=0)["fixed-1"]
    assert set(AUTOSCALERS) == {"hpa", "knative", "ray_serve"}


def with_log(env, n):
    from jaxserve.envs.base import with_static
    return with_static(env, log_capacity=n)
