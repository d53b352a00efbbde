"""The evaluation harness: exact percentiles (against `replay`'s per-request log), request
accounting, common random numbers, capacity search, and the CLI's error paths.

The routing tests share one compiled program (same environment, policies and shapes).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve import policies as P
from jaxserve.core import arrivals as A
from jaxserve.core.types import Trace
from jaxserve.evaluation.capacity import p99_lower_bound, sweep_rates
from jaxserve.scripts.evaluate import main

E, N = 2, 300


@pytest.fixture(scope="module")
def setup():
    # The default Routing-v0 cluster (4 GPUs) at a lighter load; the CLI test below builds the
    # same environment, so all routing tests share one compiled program.
    env, params = jaxserve.make("Routing-v0", arrival_rate=1.0)
    pols = {"rr": P.get("round_robin"), "jsq": P.get("jsq")}
    return env, params, pols


def _trace(n, rate, seed=0):
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    arrival -= arrival[0]
    long = rng.random(n) < 0.2
    prompt = np.where(long, 1024, 256) * np.exp(0.3 * rng.standard_normal(n))
    output = np.where(long, 512, 32) * np.exp(0.3 * rng.standard_normal(n))
    return Trace(arrival_s=arrival, prompt_tokens=np.maximum(np.round(prompt), 1),
                 output_tokens=np.maximum(np.round(output), 1))


def test_percentiles_agree_with_replay_log(setup):
    env, params, pols = setup
    tr = _trace(N, 1.0)
    res = jaxserve.evaluate_many(env, params, pols, jax.random.PRNGKey(0), E, N, trace=tr)
    for name in ("rr",):
        rep = jaxserve.replay(env, params, tr, policy=pols[name])
        np.testing.assert_array_equal(rep["gpu"], np.arange(N) % env.num_gpus)
        ok = ~rep["dropped"]
        lat = np.tile((rep["finish"] - rep["arrival"])[ok], E)  # every env replays the trace
        r = res[name]
        # Same schedule; the two compiled programs (vmapped vs not) may round float32 spans
        # differently by an ulp, hence rel=1e-6 rather than bit equality.
        np.testing.assert_allclose(np.sort(r["latencies"]), np.sort(lat), rtol=1e-6)
        for q, k in ((50, "p50_latency"), (90, "p90_latency"), (99, "p99_latency")):
            assert r[k] == pytest.approx(np.percentile(lat, q), rel=1e-6)
        assert r["mean_latency"] == pytest.approx(lat.mean(), rel=1e-6)
        assert r["max_latency"] == pytest.approx(lat.max(), rel=1e-6)
        assert r["dropped"] == E * int(rep["dropped"].sum())
        # Per-GPU busy time from the log equals the engine's counter.
        assert r["busy_time_log"] == pytest.approx(r["busy_time_total"], rel=1e-4)
        # Deterministic policy on one trace: replicates agree, so the CI is 0.
        assert r["mean_latency_ci95"] == pytest.approx(0.0, abs=1e-9)


def test_every_request_accounted_for(setup):
    env, params, pols = setup
    # Overload small queues so that requests are dropped.
    hot = params.replace(arrivals=A.poisson(20.0),
                         gpus=params.gpus.replace(queue_cap=jnp.full((4,), 2, jnp.int32)))
    res = jaxserve.evaluate_many(env, hot, pols, jax.random.PRNGKey(1), E, N)
    for r in res.values():
        assert r["arrived"] == E * N
        assert r["arrived"] == r["completed"] + r["dropped_total"] + r["in_flight"]
        assert r["in_flight"] == 0 and r["dropped_total"] > 0
        assert r["dropped"] == r["dropped_total"]  # no warmup: all requests measured
        assert r["latencies"].size == r["completed"]
        assert r["class_mix"].sum() == E * N
        assert r["throughput"] * r["sim_seconds"] == pytest.approx(r["completed"], rel=1e-9)
        assert r["goodput"] <= r["throughput"]
        assert np.all((r["utilisation"] >= 0) & (r["utilisation"] <= 1 + 1e-6))
        assert r["gpu_seconds"] == pytest.approx(r["utilisation"].sum() * r["sim_seconds"])
        assert r["busy_time_log"] == pytest.approx(r["busy_time_total"], rel=1e-4)
        assert r["invalid_actions"] == 0 and r["decisions"] == E * N
        # The engine's time-in-system counter (the reward) agrees with the per-request log.
        pen = float(hot.drop_penalty_s)
        assert r["cost_per_request"] * E * N == pytest.approx(
            r["latencies"].sum() + pen * r["dropped_total"], rel=1e-4)
    # Common random numbers: both policies saw the same requests (same sizes per class).
    np.testing.assert_array_equal(res["rr"]["class_mix"].sum(0), res["jsq"]["class_mix"].sum(0))


def test_warmup_excludes_the_first_requests(setup):
    env, params, pols = setup
    res = jaxserve.evaluate_many(env, params, pols, jax.random.PRNGKey(2), E, N, warmup=100)
    r = res["jsq"]
    assert r["measured"] == E * (N - 100)
    assert r["latencies"].size + r["dropped"] == E * (N - 100)
    assert r["arrived"] == E * N  # still simulated
    with pytest.raises(ValueError, match="warmup"):
        jaxserve.evaluate(env, params, pols["jsq"], jax.random.PRNGKey(2), E, N, warmup=N)


def test_capacity_bisection_and_impossible_slo(setup):
    env, params, pols = setup
    slo = 2.0 * p99_lower_bound(params)
    cap = jaxserve.capacity(env, params, pols["jsq"], slo, jax.random.PRNGKey(3), num_envs=E,
                            num_steps=200, candidates=4, rtol=0.05, max_rounds=4)
    assert cap["bracketed"]
    lo, hi = cap["bracket"]
    assert lo == cap["rate"] < hi
    assert cap["p99_latency"] <= slo
    hist = dict(cap["history"])
    assert hist[hi] > slo  # the first failing candidate
    assert cap["rounds"] >= 2
    # The same program serves a load sweep (vmapped over rates).
    rates = [lo, hi, 1.5 * hi, 2 * hi]
    sw = sweep_rates(env, params, {"jsq": pols["jsq"]}, rates, jax.random.PRNGKey(3), E, 200)
    assert [r["rate"] for r in sw["jsq"]] == rates
    assert sw["jsq"][0]["p99_with_drops"] == pytest.approx(cap["p99_latency"])
    # Impossible: below the bare service time of the slowest 1% -> ValueError, no simulation.
    with pytest.raises(ValueError, match="impossible"):
        jaxserve.capacity(env, params, pols["jsq"], 0.5 * p99_lower_bound(params))
    with pytest.raises(ValueError, match="positive"):
        jaxserve.capacity(env, params, pols["jsq"], -1.0)


def test_evaluate_rejects_bad_arguments(setup):
    env, params, pols = setup
    with pytest.raises(ValueError, match="num_envs"):
        jaxserve.evaluate(env, params, pols["jsq"], jax.random.PRNGKey(0), 0, 10)
    with pytest.raises(ValueError, match="Routing or Batching"):
        jaxserve.evaluate(object(), params, pols["jsq"], jax.random.PRNGKey(0), 1, 10)
    with pytest.raises(ValueError, match="not both"):
        jaxserve.replay(env, params, _trace(5, 1.0), actions=np.zeros(5, int),
                        policy=pols["jsq"])


# ----------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("argv, needle", [
    (["--env", "Nope-v0"], "unknown environment 'Nope-v0'"),
    (["--policies", "jsq,teleport"], "unknown policy 'teleport'"),
    (["--env", "Batching-v0", "--policies", "jsq"], "is a routing policy"),
    (["--trace", "/definitely/not/here.csv"], "trace file not found"),
    (["--slo-p99", "0.001"], "impossible"),
    (["--slo-p99", "-3"], "positive"),
    (["--loads", "1,x"], "--loads"),
    (["--num-envs", "0"], "--num-envs"),
    (["--num-envs", "two"], "invalid int value"),
    (["--bogus-flag"], "unrecognized arguments"),
])
def test_cli_errors_are_one_line(argv, needle, capsys, tmp_path):
    rc = main(argv + ["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("jaxserve-eval: error:") and needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_malformed_trace(capsys, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,12,x\n")
    assert main(["--trace", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxserve-eval: error:") and err.count("\n") == 1
    assert "bad.csv" in err  # the trace's error, not --out's
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert main(["--trace", str(empty), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxserve-eval: error:") and "empty.csv" in err


def test_cli_writes_csv_json_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["--env", "Routing-v0", "--rate", "1.0", "--policies", "rr,jsq".replace(
        "rr", "round_robin"), "--num-envs", str(E), "--num-steps", str(N), "--loads", "",
        "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "round_robin" in printed and "jsq" in printed
    doc = json.loads((out / "results.json").read_text())
    assert doc["results"]["jsq"]["arrived"] == E * N
    assert doc["command"].startswith("jaxserve-eval --env Routing-v0")
    assert (out / "results.csv").read_text().splitlines()[0].startswith("policy,mean_latency")
    for png in ("latency_cdf.png", "class_mix.png"):
        assert (out / png).stat().st_size > 0


def test_class_mix_by_phase_splits_requests_by_arrival_phase():
    """`class_mix_by_phase` is `class_mix` split by each request's arrival phase: in
    short_bursts the bursts (phase 1) bring short requests only, so no request of a longer
    class may be counted in phase 1; Poisson arrivals have one phase."""
    import importlib

    # The module, not the `evaluate` function the package re-exports under the same name.
    E = importlib.import_module("jaxserve.evaluation.evaluate")
    env, params = jaxserve.make("Routing-v0", scenario="short_bursts")
    key = jax.random.PRNGKey(31)
    streams, keys = E.make_streams(key, params, 3, 400, None)
    s2, k2, phases = E.make_streams_with_phase(key, params, 3, 400, None)
    for a, b in zip(jax.tree.leaves((streams, keys)), jax.tree.leaves((s2, k2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ph = np.asarray(phases)
    assert set(np.unique(ph)) == {0, 1}
    cls = np.asarray(A.size_class(streams.output, params.size_edges))
    assert (cls[ph == 1] == 0).all() and (cls[ph == 0] > 0).any()
    res = jaxserve.evaluate(env, params, P.get("round_robin"), key, num_envs=3, num_steps=400,
                            warmup=20)
    by_phase = res["class_mix_by_phase"]
    assert by_phase.shape == (2,) + res["class_mix"].shape
    np.testing.assert_array_equal(by_phase.sum(axis=0), res["class_mix"])
    assert by_phase[1, :, 1:].sum() == 0 and by_phase[1].sum() > 0
    assert by_phase.sum() == res["measured"]
    env0, params0 = jaxserve.make("Routing-v0")
    r0 = jaxserve.evaluate(env0, params0, P.get("round_robin"), key, num_envs=2, num_steps=50)
    assert r0["class_mix_by_phase"].shape[0] == 1
