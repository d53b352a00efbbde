"""The rollout-serving workload (`jaxserve.workloads.rollout`): arithmetic, vmap, reference.

Deterministic cases use dyadic service coefficients and fixed token lengths, so every batch
time is exact in float32 and the makespans can be compared with hand arithmetic exactly.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core import arrivals as A
from jaxserve.core.types import GPUProfile
from jaxserve.core import stats
from jaxserve.workloads import rollout as W
from jaxserve.reference import sim as ref

# Dyadic coefficients: every service time below is exact in float32 and float64.
PROF = GPUProfile(c0=0.5, alpha=2.0 ** -10, alpha2=0.0, beta=2.0 ** -4, gamma=2.0 ** -8,
                  delta=2.0 ** -16, max_batch=3, queue_cap=64, timeout=0.0, name="dyadic")
P_TOK, O_TOK = 64, 32


def batch_time(sizes_outputs, p=P_TOK, prof=PROF):
    """T(S) by hand (float64) for a batch given as a list of output lengths, prompts `p`."""
    k = len(sizes_outputs)
    return (prof.c0 + prof.alpha * p * k + prof.alpha2 * p * p * k
            + max(sizes_outputs) * (prof.beta + prof.gamma * k + prof.delta * p * k))


def rr_makespan(k, r, b):
    """Round robin of k equal requests to r replicas, batches of b back to back (timeout 0)."""
    spans, batches = [], 0
    for i in range(r):
        n = k // r + (1 if i < k % r else 0)
        full, rest = divmod(n, b)
        spans.append(full * batch_time([O_TOK] * b) + (batch_time([O_TOK] * rest) if rest else 0))
        batches += full + (1 if rest else 0)
    return max(spans), batches


def det_params(k, **kw):
    return W.make_params(k, gpu=PROF, tokens=A.fixed_tokens(P_TOK, O_TOK),
                         estimate_mode="exact", **kw)


@partial(jax.jit, static_argnames=("k", "r_max"))
def run_grid(key, params, rules, reps, k, r_max):
    """Every (rule, num_replicas) point of one request draw, vmapped."""
    def one(rule, r):
        return W.simulate_iteration(key, params.replace(num_replicas=r), rule,
                                    num_requests=k, max_replicas=r_max)
    return jax.vmap(jax.vmap(one, (None, 0)), (0, None))(rules, reps)


ALL_RULES = jnp.arange(len(W.RULES), dtype=jnp.int32)


# One static shape (K, R) for the vmapped grids below, so they share one compiled program.
K, R = 10, 4


def test_deterministic_makespan_speedup_and_gpu_hours_match_arithmetic():
    k, r_max, train_s = K, R, 5.0
    params = det_params(k, train_s=train_s)
    out = jax.tree.map(np.asarray, run_grid(jax.random.PRNGKey(0), params, ALL_RULES,
                                            jnp.arange(1, r_max + 1), k, r_max))
    rr = W.RULES.index("round_robin")
    t1 = rr_makespan(k, 1, PROF.max_batch)[0] + train_s
    for r in range(1, r_max + 1):
        want, batches = rr_makespan(k, r, PROF.max_batch)
        got = out["makespan_s"][rr, r - 1]
        assert got == np.float32(want), (r, got, want)
        assert out["iteration_s"][rr, r - 1] == np.float32(want + train_s)
        assert out["batches"][rr, r - 1] == batches
        assert out["completed"][rr, r - 1] == k and out["dropped"][rr, r - 1] == 0
        t = float(out["iteration_s"][rr, r - 1])
        np.testing.assert_allclose(out["gpu_hours"][rr, r - 1], r * t / 3600.0, rtol=1e-7)
        np.testing.assert_allclose(t1 / t, t1 / (want + train_s), rtol=1e-7)
    # With equal requests all at time 0, jsq and least-work-left balance exactly like round
    # robin; the sorted rules see ties (stable order) and cannot do better.
    for name in ("jsq", "least_work_left"):
        np.testing.assert_array_equal(out["makespan_s"][W.RULES.index(name)],
                                      out["makespan_s"][rr])
    # More replicas never slow the deterministic iteration down, under any rule.
    assert np.all(np.diff(out["makespan_s"], axis=1) <= 0), out["makespan_s"]
    for leaf in jax.tree.leaves(out):
        assert np.all(np.isfinite(leaf))


def test_sweep_table_deterministic():
    k, r_max, train_s = 10, 4, 5.0
    params = det_params(k, train_s=train_s)
    rows = W.sweep(jax.random.PRNGKey(1), params, num_requests=k, max_replicas=r_max,
                   rules=["round_robin", "lpt_batch"], max_batches=[3, 4], iterations=2,
                   train_s=[0.0, train_s])
    assert len(rows) == 2 * 2 * 2 * r_max
    for row in rows:
        if row["rule"] != "round_robin":
            continue
        b, r, ts = row["max_batch"], row["replicas"], row["train_s"]
        prof_b = PROF.replace(max_batch=b)
        span = lambda rr_: rr_makespan_b(k, rr_, b, prof_b)  # noqa: E731
        t = span(r) + ts
        np.testing.assert_allclose(row["iteration_s"], t, rtol=1e-6)
        np.testing.assert_allclose(row["speedup"], (span(1) + ts) / t, rtol=1e-6)
        np.testing.assert_allclose(row["gpu_hours"], r * t / 3600.0, rtol=1e-6)
        np.testing.assert_allclose(row["efficiency"], row["speedup"] / r, rtol=1e-12)
        if r == 1:
            assert row["speedup"] == 1.0 and math.isnan(row["marginal_speedup_per_gpu_hour"])
            assert row["speedup_ci95"] == 0.0
    # Marginal speedup per extra GPU-hour is the finite difference between consecutive r.
    by = {(x["train_s"], x["max_batch"], x["rule"], x["replicas"]): x for x in rows}
    for (ts, b, rule, r), x in by.items():
        if r > 1:
            p = by[(ts, b, rule, r - 1)]
            dh = x["gpu_hours"] - p["gpu_hours"]
            if dh > 0:
                np.testing.assert_allclose(x["marginal_speedup_per_gpu_hour"],
                                           (x["speedup"] - p["speedup"]) / dh, rtol=1e-9)
    ref_row = by[(0.0, 3, "round_robin", 1)]
    assert ref_row["speedup_vs_ref"] == 1.0


def rr_makespan_b(k, r, b, prof):
    spans = []
    for i in range(r):
        n = k // r + (1 if i < k % r else 0)
        full, rest = divmod(n, b)
        spans.append(full * batch_time([O_TOK] * b, prof=prof)
                     + (batch_time([O_TOK] * rest, prof=prof) if rest else 0))
    return max(spans)


def test_timeout_semantics_are_the_engines():
    # A partial batch alone in a queue waits for the timeout; one left behind a full batch
    # goes as soon as the replica frees up (its deadline has passed by then).
    tau = 2.0
    params = W.make_params(K, gpu=PROF.replace(timeout=tau), tokens=A.fixed_tokens(P_TOK, O_TOK),
                           estimate_mode="exact")
    out = jax.tree.map(np.asarray, run_grid(jax.random.PRNGKey(0), params, ALL_RULES,
                                            jnp.arange(1, R + 1), K, R))
    t3, t1, t2 = (batch_time([O_TOK] * n) for n in (3, 1, 2))
    assert t3 > tau and tau + t2 > t3
    rr = out["makespan_s"][W.RULES.index("round_robin")]
    assert rr[0] == np.float32(3 * t3 + t1)  # 10 = 3 + 3 + 3 + 1 on one replica
    assert rr[1] == np.float32(t3 + t2)  # 5 = 3 + 2 each
    assert rr[2] == np.float32(t3 + t1)  # 4, 3, 3
    assert rr[3] == np.float32(tau + t2)  # 3, 3, 2, 2: the pairs wait for the timeout


def run_requests(params, rule, prompt, output, estimate):
    """One iteration of given requests (K of them), per-request detail; one compiled shape."""
    return W.simulate(jax.random.PRNGKey(0), params, rule, num_requests=K, max_replicas=R,
                      per_request=True, requests=(prompt, output, estimate))


def test_size_aware_rules_by_hand():
    # Two long rollouts among short ones, batches of 2, two replicas, exact estimates.
    prof = PROF.replace(max_batch=2)
    out_tok = np.array([1000, 10, 10, 10, 1000, 10, 10, 10, 10, 10], np.float64)
    prompt = np.full(K, P_TOK, np.float64)
    params = W.make_params(K, gpu=prof, estimate_mode="exact", num_replicas=2)
    got = {rule: run_requests(params, rule, prompt, out_tok, out_tok) for rule in W.RULES}
    t_long = batch_time([1000, 10], prof=prof)  # = batch_time([1000, 1000]): max o matters
    t_short, t_one = batch_time([10, 10], prof=prof), batch_time([10], prof=prof)
    # Round robin: replica 0 gets requests 0, 2, 4, 6, 8: both long ones, in two batches.
    np.testing.assert_array_equal(got["round_robin"]["replica"], [0, 1] * 5)
    assert got["round_robin"]["makespan_s"] == np.float32(2 * t_long + t_one)
    np.testing.assert_array_equal(got["jsq"]["replica"], got["round_robin"]["replica"])
    # LPT: the long ones go to different replicas, each followed by short ones.
    np.testing.assert_array_equal(got["lpt"]["route_order"], [0, 4, 1, 2, 3, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(got["lpt"]["replica"], [0, 0, 1, 0, 1, 1, 0, 1, 0, 1])
    assert got["lpt"]["makespan_s"] == np.float32(t_long + t_short + t_one)
    # Batch-level LPT: both long ones share one batch; the other replica runs the rest.
    np.testing.assert_array_equal(got["lpt_batch"]["replica"], [0, 1, 1, 1, 0, 1, 1, 1, 1, 1])
    assert 4 * t_short < t_long
    assert got["lpt_batch"]["makespan_s"] == np.float32(t_long)
    assert (got["lpt_batch"]["makespan_s"] < got["lpt"]["makespan_s"]
            < got["round_robin"]["makespan_s"])


def lognormal_params(k, **kw):
    prof = PROF.replace(max_batch=4, c0=0.01, alpha=1e-4, alpha2=1e-9, beta=0.03, gamma=3e-4,
                        delta=1e-7)
    return W.make_params(k, gpu=prof, tokens=A.lognormal_tokens(256, 0.5, 200, 1.2,
                                                                max_output=4096), **kw)


def test_vmap_over_replicas_and_rules_matches_per_point_runs():
    k, r_max = K, R
    params = lognormal_params(k, train_s=7.0, estimate_mode="noisy")
    key = jax.random.PRNGKey(3)
    grid = jax.tree.map(np.asarray, run_grid(key, params, ALL_RULES, jnp.arange(1, r_max + 1),
                                             k, r_max))
    for q, rule in enumerate(W.RULES):
        for r in range(1, r_max + 1):
            one = W.simulate(key, params.replace(num_replicas=jnp.int32(r)), rule,
                             num_requests=k, max_replicas=r_max)
            for f, v in one.items():
                if np.issubdtype(v.dtype, np.integer):
                    assert grid[f][q, r - 1] == v, (rule, r, f)
                else:
                    np.testing.assert_allclose(grid[f][q, r - 1], v, rtol=1e-5, err_msg=f)


@pytest.mark.parametrize("timeout", [0.0, 3.0])
def test_schedules_match_reference_simulator(timeout):
    """Given the routing each rule chose, the engine's schedule equals the event-by-event
    reference (`jaxserve/reference/sim.py`) fed the requests in routing (queue) order."""
    rng = np.random.default_rng(int(timeout) + 7)
    prompt = np.rint(rng.lognormal(np.log(256), 0.5, K)).clip(1)
    output = np.rint(rng.lognormal(np.log(200), 1.2, K)).clip(1, 4096)
    estimate = np.rint(output * rng.lognormal(0.0, 0.5, K)).clip(1)
    params = lognormal_params(K, num_replicas=3)
    params = params.replace(gpu=params.gpu.replace(max_batch=jnp.int32(2),
                                                   timeout=jnp.float32(timeout)))
    prof = {f: float(np.asarray(getattr(params.gpu, f))) for f in ref.PROFILE_KEYS}
    for rule in W.RULES:
        got = run_requests(params, rule, prompt, output, estimate)
        order = got["route_order"]
        assert np.all(got["replica"] < 3)
        # The summary's percentiles are the evaluation's (stats), over the served latencies.
        np.testing.assert_allclose([got["p50_latency_s"], got["p99_latency_s"]],
                                   stats.percentiles(got["latency_s"], [50, 99]), rtol=1e-6)
        want = ref.simulate(np.zeros(K), prompt[order].astype(np.int64),
                            output[order].astype(np.int64), got["replica"][order], [prof] * 3)
        assert not want["dropped"].any()
        np.testing.assert_allclose(got["latency_s"][order], want["finish"], rtol=2e-6,
                                   err_msg=rule)
        np.testing.assert_allclose(got["makespan_s"], want["finish"].max(), rtol=2e-6)
        assert got["batches"] == len(want["batches"])


def test_heavy_tails_and_edge_cases_stay_finite():
    # Timeout > 0, size-class estimates, a very long tail, large batches (so r = 4 replicas
    # are more than lpt_batch's chunks need), GPU counts per replica and a trainer.
    params = W.make_params(K, gpu=PROF.replace(max_batch=8, timeout=1.5), estimate_mode="class",
                           train_s=0.0, trainer_gpus=8.0, gpus_per_replica=4.0,
                           tokens=A.lognormal_tokens(2048, 1.0, 500, 2.5, max_output=32768))
    out = jax.tree.map(np.asarray, run_grid(jax.random.PRNGKey(5), params, ALL_RULES,
                                            jnp.arange(1, R + 1), K, R))
    for f, v in out.items():
        assert np.all(np.isfinite(v)), f
    assert np.all(out["completed"] == K) and np.all(out["dropped"] == 0)
    assert np.all(out["makespan_s"] > 0)
    np.testing.assert_allclose(out["max_latency_s"], out["makespan_s"], rtol=1e-6)
    assert np.all(out["p50_latency_s"] <= out["p99_latency_s"])
    t = out["iteration_s"]
    np.testing.assert_allclose(out["gpu_hours"], np.arange(1, R + 1) * 4.0 * t / 3600,
                               rtol=1e-6)
    np.testing.assert_allclose(out["trainer_gpu_hours"], 8.0 * t / 3600, rtol=1e-6)
    assert np.all(out["utilisation"] <= 1.0 + 1e-6)
    one = W.simulate(jax.random.PRNGKey(0), W.make_params(1, gpu="mid"), "lpt_batch",
                     num_requests=1, max_replicas=3)
    assert one["completed"] == 1 and np.isfinite(one["makespan_s"]) and one["makespan_s"] > 0


def test_invalid_configuration_raises_naming_the_field():
    k = 8
    params = det_params(k)
    key = jax.random.PRNGKey(0)
    for r in (0, 5):
        with pytest.raises(ValueError, match="num_replicas"):
            W.simulate(key, params.replace(num_replicas=jnp.int32(r)), num_requests=k,
                       max_replicas=4)
    with pytest.raises(ValueError, match="num_replicas"):
        W.simulate(key, params.replace(num_replicas=jnp.float32(1.5)), num_requests=k,
                   max_replicas=4)
    with pytest.raises(ValueError, match="num_requests"):
        W.simulate(key, params, num_requests=0, max_replicas=2)
    with pytest.raises(ValueError, match="max_replicas"):
        W.sweep(key, params, num_requests=k, max_replicas=0)
    with pytest.raises(ValueError, match="train_s"):
        W.simulate(key, params.replace(train_s=jnp.float32(-1)), num_requests=k)
    with pytest.raises(ValueError, match="queue_cap"):
        W.simulate(key, params, num_requests=100, max_replicas=2)
    with pytest.raises(ValueError, match="routing rule"):
        W.simulate(key, params, "fastest", num_requests=k)
    with pytest.raises(ValueError, match="estimate_mode"):
        W.make_params(k, gpu=PROF, estimate_mode="psychic")
    with pytest.raises(ValueError, match="gpus_per_replica"):
        W.simulate(key, params.replace(gpus_per_replica=jnp.float32(0)), num_requests=k)
    with pytest.raises(ValueError, match="max_batches"):
        W.sweep(key, params, num_requests=k, max_replicas=2, max_batches=[0])
    with pytest.raises(ValueError, match="iterations"):
        W.sweep(key, params, num_requests=k, max_replicas=2, iterations=0)
    with pytest.raises(ValueError, match="max_batch"):
        W.make_params(k, gpu="mid", max_batch=0)
    # make_params raises a too-small queue_cap to K rather than dropping rollouts.
    assert int(W.make_params(500, gpu="mid").gpu.queue_cap) == 500


def test_pareto_front():
    s = [1.0, 1.8, 1.7, 2.5, 2.4, 1.0]
    h = [1.0, 1.2, 1.3, 2.0, 2.1, 0.9]
    np.testing.assert_array_equal(W.pareto_front(s, h), [5, 1, 3])


def test_empirical_lengths_from_a_real_trace():
    from jaxserve.traces import find, load
    path = find("azure_llm_2023_conv")
    if path is None:
        pytest.skip("azure_llm_2023_conv not available (set JAXSERVE_TRACES_DIR or run "
                    "`jaxserve-traces fetch azure_llm_2023_conv`)")
    tr = load(path)
    k = 16
    params = W.make_params(k, gpu="mid", tokens=A.empirical_tokens(tr.prompt_tokens,
                                                                   tr.output_tokens))
    out = W.simulate(jax.random.PRNGKey(0), params, "lpt", num_requests=k, per_request=True)
    assert out["completed"] == k and np.isfinite(out["makespan_s"])
    assert np.all(np.isin(out["output"], tr.output_tokens))
