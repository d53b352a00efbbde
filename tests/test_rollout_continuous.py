"""The rollout workload on continuous-batching replicas (`workloads.rollout`; docs/continuous.md,
"Rollout workload with continuous replicas").

A hand-computed iteration (dyadic coefficients: exact in float32), and per-request equality
with the event-by-event reference `jaxserve/reference/continuous.py` for every continuous rule.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core import arrivals as A
from jaxserve.core.replica import ReplicaProfile
from jaxserve.workloads import rollout as W
from jaxserve.reference import continuous as ref

# Iteration time c0 + alpha * tokens: a prefill of 2 x 8 tokens takes 0.75 s, a decode of 2
# sequences 0.53125 s.
PROF = ReplicaProfile(c0=0.5, alpha=2.0 ** -6, kv_blocks=1000, block_size=4, max_seqs=2,
                      max_tokens=64, watermark=0.0, queue_cap=8, name="dyadic")


def hand_params(k, **kw):
    return W.make_params(k, gpu=PROF, tokens=A.fixed_tokens(8, 3), estimate_mode="exact", **kw)


def test_hand_computed_iteration():
    # 2 replicas x 2 requests (round robin): prefill 0.75 s (first tokens), then two decode
    # iterations of 0.53125 s: every request finishes at 1.8125 s; 3 iterations per replica.
    p = hand_params(4, num_replicas=2, train_s=10.0, gpus_per_replica=2.0)
    out = W.simulate(jax.random.PRNGKey(0), p, "round_robin", num_requests=4, per_request=True)
    np.testing.assert_array_equal(out["replica"], [0, 1, 0, 1])
    np.testing.assert_array_equal(out["ttft_s"], [0.75] * 4)
    np.testing.assert_array_equal(out["latency_s"], [1.8125] * 4)
    assert float(out["makespan_s"]) == 1.8125
    assert float(out["iteration_s"]) == 11.8125
    assert float(out["busy_s"]) == 2 * 1.8125
    assert int(out["batches"]) == 6 and int(out["dropped"]) == 0
    np.testing.assert_allclose(out["gpu_hours"], 2 * 2.0 * 11.8125 / 3600, rtol=1e-6)
    # One replica, max_seqs = 2: the second pair is admitted when the first finishes.
    one = W.simulate(jax.random.PRNGKey(0), hand_params(4), "jsq", num_requests=4,
                     per_request=True)
    np.testing.assert_array_equal(np.sort(one["latency_s"]), [1.8125] * 2 + [3.625] * 2)
    assert float(one["makespan_s"]) == 3.625


def dyadic_profile(rng):
    return ReplicaProfile(
        c0=float(rng.choice([0.25, 0.5])), alpha=2.0 ** -int(rng.integers(5, 8)),
        alpha2=float(rng.choice([0.0, 2.0 ** -10])), beta=float(rng.choice([0.0, 0.125])),
        gamma=float(rng.choice([0.0, 2.0 ** -5])), delta=float(rng.choice([0.0, 2.0 ** -9])),
        kv_blocks=int(rng.integers(9, 13)), block_size=4, max_seqs=4,
        max_tokens=int(rng.choice([32, 64])), chunked_prefill=bool(rng.integers(2)),
        watermark=float(rng.choice([0.0, 0.125])), queue_cap=32, name="dyadic")


@pytest.mark.parametrize("seed", [0, 1])
def test_equals_reference(seed):
    """Every request's finish time (and drops) equal the reference's, whatever the rule; the
    makespan is the last finish. Small KV caches make preemption and never-fit drops happen."""
    rng = np.random.default_rng(seed)
    prof = dyadic_profile(rng)
    k, r = 16, 2
    prompt = rng.integers(1, 12, size=k).astype(np.float64)
    output = rng.integers(1, 32, size=k).astype(np.float64)  # long decodes grow the cache
    p = W.make_params(k, gpu=prof, estimate_mode="exact", num_replicas=r)
    seen_pre = 0
    for rule in W.CONTINUOUS_RULES:
        out = W.simulate(jax.random.PRNGKey(0), p, rule, num_requests=k, per_request=True,
                         requests=(prompt, output, output))
        order = out["route_order"]
        d = {f: getattr(prof, f) for f in ref.REPLICA_KEYS}
        want = ref.simulate(np.zeros(k), prompt[order].astype(int), output[order].astype(int),
                            out["replica"][order], [d] * r)
        finish = np.full(k, np.nan)
        finish[order] = want["finish"]
        dropped = np.zeros(k, bool)
        dropped[order] = want["dropped"]
        assert int(out["dropped"]) == int(dropped.sum())
        np.testing.assert_array_equal(out["latency_s"][~dropped], finish[~dropped])
        assert float(out["makespan_s"]) == np.nanmax(finish)
        assert int(out["preemptions"]) == int(want["replica_preemptions"].sum())
        assert int(out["batches"]) == int(want["iterations"].sum())
        seen_pre += int(out["preemptions"])
    assert seen_pre > 0  # the case exercises preemption


def test_sweep_vmaps_rules_replicas_and_max_seqs():
    p = hand_params(8)
    raw = W.sweep_raw(jax.random.PRNGKey(0), p, num_requests=8, max_replicas=2,
                      max_batches=[1, 2], iterations=2)
    assert raw["rules"] == list(W.CONTINUOUS_RULES)
    mk = raw["makespan_s"]  # (max_seqs, rules, r, seeds)
    assert mk.shape == (2, 4, 2, 2)
    # Fixed sizes: max_seqs 1 runs 8 requests one by one, each 0.5 + 8/64 then 2 x (0.5 + 1/64).
    one = 0.625 + 2 * 0.515625
    np.testing.assert_array_equal(mk[0, :, 0, :], 8 * one)
    np.testing.assert_array_equal(mk[1, :, 0, :], 4 * 1.8125)
    np.testing.assert_array_equal(mk[1, :, 1, :], 2 * 1.8125)
    rows = W.tabulate(raw, train_s=0.0)
    assert {r["rule"] for r in rows} == set(W.CONTINUOUS_RULES)


def test_lpt_batch_refused_and_jit_clips_it():
    p = hand_params(4)
    with pytest.raises(ValueError, match="lpt_batch"):
        W.simulate(jax.random.PRNGKey(0), p, "lpt_batch", num_requests=4)
    a = W.simulate_iteration(jax.random.PRNGKey(0), p, jnp.int32(W.LPT_BATCH), num_requests=4,
                             max_replicas=1)
    b = W.simulate_iteration(jax.random.PRNGKey(0), p, jnp.int32(W.LPT), num_requests=4,
                             max_replicas=1)
    assert float(a["makespan_s"]) == float(b["makespan_s"])


def test_same_draws_as_static_replicas():
    """Continuous and static replicas see the same requests for the same key (paired)."""
    pc = W.make_params(16, gpu="opt13b-a100-80g")
    ps = W.make_params(16, gpu="mid")
    a = W.simulate(jax.random.PRNGKey(3), pc, "round_robin", num_requests=16, per_request=True)
    b = W.simulate(jax.random.PRNGKey(3), ps, "round_robin", num_requests=16, per_request=True)
    np.testing.assert_array_equal(a["prompt"], b["prompt"])
    np.testing.assert_array_equal(a["output"], b["output"])
    assert np.all(np.isfinite(a["latency_s"])) and float(a["makespan_s"]) > 0
