"""The continuous-batching engine (`core/continuous.py`) against the event-by-event reference.

Workloads on a dyadic grid (arrivals on multiples of 1/4 s, coefficients powers of two, small
token counts) make every time exactly representable in float32 and float64, so the engine must
match `jaxserve/reference/continuous.py` *exactly*: first-token and finish times, drops and
preemption counts of every request. Tiny KV caches force preemptions; coarse arrival grids force
ties between arrivals and iteration ends.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.core import continuous as CB
from jaxserve.core import cpu_numerics as N
from jaxserve.core.decode_run import decode_run
from jaxserve.core.replica import (ReplicaProfile, kv_blocks_for, replica_profile,
                                   stack_replicas, validate_replica)
from jaxserve.reference import continuous as ref

N_REQ = 96  # one trace length for the exact tests: one compilation shared by all of them


def as_dicts(profiles):
    return [{k: getattr(p, k) for k in ref.REPLICA_KEYS} for p in profiles]


def dyadic_replica(rng, chunked, watermark, kv_blocks, max_seqs=4, queue_cap=None):
    return ReplicaProfile(
        c0=float(rng.choice([0.25, 0.5])), alpha=2.0 ** -int(rng.integers(5, 8)),
        alpha2=float(rng.choice([0.0, 2.0 ** -10])), beta=float(rng.choice([0.0, 0.125])),
        gamma=float(rng.choice([0.0, 2.0 ** -5, -2.0 ** -8])),
        delta=float(rng.choice([0.0, 2.0 ** -9])), kv_blocks=int(kv_blocks), block_size=4,
        max_seqs=int(max_seqs), max_tokens=int(rng.choice([8, 16, 32])),
        chunked_prefill=bool(chunked), watermark=float(watermark),
        queue_cap=int(rng.integers(2, 7)) if queue_cap is None else queue_cap,
        moe=float(rng.choice([0.0, 2.0 ** -6])), moe_tokens=4)


def env_for(profiles, queue_buffer=8, max_seqs=4):
    return jaxserve.make("LLMRouting-v0", replicas=profiles, queue_buffer=queue_buffer,
                         max_seqs=max_seqs)


def run_both(profiles, arrival, prompt, output, replica, **env_kw):
    env, params = env_for(profiles, **env_kw)
    got = jaxserve.replay(env, params, jaxserve.Trace(arrival, prompt, output), actions=replica)
    want = ref.simulate(arrival, prompt, output, replica, as_dicts(profiles))
    return got, want


def assert_same(got, want, atol=0.0):
    np.testing.assert_array_equal(got["dropped"], want["dropped"])
    ok = ~want["dropped"]
    assert np.all(np.isnan(got["finish"][~ok])) and np.all(np.isnan(got["first_token"][~ok]))
    np.testing.assert_allclose(got["first_token"][ok], want["first_token"][ok], rtol=0,
                               atol=atol)
    np.testing.assert_allclose(got["finish"][ok], want["finish"][ok], rtol=0, atol=atol)
    np.testing.assert_array_equal(got["preemptions"], want["preemptions"])


def dyadic_workload(rng, n=N_REQ, grid=(0.0, 0.0, 0.25, 0.5, 1.0)):
    arrival = np.cumsum(rng.choice(grid, size=n))
    prompt = rng.integers(1, 24, size=n)
    output = rng.integers(1, 16, size=n)
    return arrival, prompt, output


EXACT_CONFIGS = [(True, 0.0), (False, 0.0), (True, 0.25), (False, 0.125)]


def exact_case(seed, chunked, watermark):
    rng = np.random.default_rng(100 * seed + int(chunked) * 10 + int(watermark * 8))
    arrival, prompt, output = dyadic_workload(rng)
    # 10-16 blocks of 4 tokens: a few requests fill the cache, so preemption is frequent.
    profiles = [dyadic_replica(rng, chunked, watermark, kv_blocks=int(rng.integers(10, 17)))
                for _ in range(2)]
    return profiles, arrival, prompt, output, rng.integers(0, 2, size=N_REQ)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("chunked,watermark", EXACT_CONFIGS)
def test_dyadic_matches_reference_exactly(seed, chunked, watermark):
    profiles, arrival, prompt, output, replica = exact_case(seed, chunked, watermark)
    got, want = run_both(profiles, arrival, prompt, output, replica)
    assert_same(got, want)


def test_exact_runs_cover_preemption_drops_and_never_fit():
    """The dyadic workloads above do exercise every rule (guards against vacuous equality)."""
    totals = np.zeros(3, int)
    for seed in range(4):
        for chunked, watermark in EXACT_CONFIGS:
            profiles, arrival, prompt, output, replica = exact_case(seed, chunked, watermark)
            want = ref.simulate(arrival, prompt, output, replica, as_dicts(profiles))
            totals += [want["preemptions"].sum(),
                       (want["dropped"] & ~want["never_fit"]).sum(), want["never_fit"].sum()]
    assert np.all(totals > 0), totals


def test_per_replica_counters_match_reference():
    """Iterations, preemptions, busy time, KV block-seconds and peak KV use of each replica,
    from the environment's state after a drained trace episode."""
    from jaxserve.core.sources import trace_arrays

    profiles, arrival, prompt, output, replica = exact_case(1, True, 0.0)
    want = ref.simulate(arrival, prompt, output, replica, as_dicts(profiles))
    env, params = env_for(profiles)
    env = env.replace_static(trace_len=N_REQ)
    params = params.replace(trace=trace_arrays(jaxserve.Trace(arrival, prompt, output)),
                            max_steps_in_episode=jnp.int32(10 * N_REQ))

    @jax.jit
    def go(key, actions):
        _, state = env.reset_env(key, params)

        def step(state, x):
            k, a = x
            _, state, _, _, info = env.step_env(k, state, a, params)
            return state, info

        return jax.lax.scan(step, state, (jax.random.split(key, N_REQ), actions))

    state, info = go(jax.random.PRNGKey(0), jnp.asarray(replica, jnp.int32))
    c = state.cluster
    assert int(c.queues.count.sum() + c.run.count.sum()) == 0  # the last step drained
    np.testing.assert_array_equal(c.iterations, want["iterations"])
    np.testing.assert_array_equal(c.preemptions, want["replica_preemptions"])
    np.testing.assert_array_equal(c.kv_peak, want["kv_peak"])
    np.testing.assert_allclose(c.busy, want["busy"], rtol=1e-6)
    np.testing.assert_allclose(c.kv_block_s, want["kv_block_s"], rtol=1e-6)
    assert int(info["preemptions"].sum()) == want["preemptions"].sum()
    assert int(info["completed"].sum()) == (~want["dropped"]).sum()
    ok = ~want["dropped"]
    np.testing.assert_allclose(float(info["ttft_sum"].sum()),
                               (want["first_token"] - arrival)[ok].sum(), rtol=1e-6)
    np.testing.assert_allclose(float(info["latency_sum"].sum()),
                               (want["finish"] - arrival)[ok].sum(), rtol=1e-6)
    np.testing.assert_allclose(float(info["busy_time"].sum()), want["busy"].sum(), rtol=1e-6)
    # Time-in-system of the drained episode is the summed latency of completed requests.
    np.testing.assert_allclose(float(info["in_system_time"].sum()),
                               (want["finish"] - arrival)[ok].sum(), rtol=1e-6)


def test_continuous_random_workloads_match_reference():
    rng = np.random.default_rng(5)
    n = N_REQ
    arrival = np.cumsum(rng.exponential(0.2, size=n))
    prompt = rng.integers(1, 300, size=n)
    output = rng.integers(1, 60, size=n)
    profiles = [ReplicaProfile(
        c0=rng.uniform(0.005, 0.02), alpha=rng.uniform(1e-5, 1e-4), alpha2=rng.uniform(0, 1e-8),
        beta=rng.uniform(0, 2e-3), gamma=rng.uniform(-1e-5, 1e-4), delta=rng.uniform(0, 1e-6),
        kv_blocks=int(rng.integers(40, 80)), block_size=16, max_seqs=4,
        max_tokens=int(rng.choice([256, 512])), chunked_prefill=bool(g % 2), watermark=0.01,
        queue_cap=int(rng.integers(3, 8))) for g in range(2)]
    replica = rng.integers(0, 2, size=n)
    got, want = run_both(profiles, arrival, prompt, output, replica)
    assert want["preemptions"].sum() > 0
    # Spans here are < 100 s; float32 keeps them to ~1e-5 s.
    assert_same(got, want, atol=1e-4)


def test_long_episode_stays_exact():
    """4000 requests over ~4000 s on the dyadic grid: the rebased float32 clock stays exact."""
    rng = np.random.default_rng(11)
    n = 4000
    arrival, prompt, output = dyadic_workload(rng, n, grid=(0.0, 0.5, 1.0, 1.5, 2.0))
    profiles = [dyadic_replica(rng, g == 0, 0.125, kv_blocks=24, queue_cap=6) for g in range(2)]
    replica = rng.integers(0, 2, size=n)
    got, want = run_both(profiles, arrival, prompt, output, replica)
    assert arrival[-1] > 3000 and want["preemptions"].sum() > 0
    assert_same(got, want)


def test_ties_at_one_instant():
    """Requests arriving together, and arrivals exactly at iteration ends, queue before the
    next iteration is scheduled (MODEL.md event order)."""
    prof = ReplicaProfile(c0=0.5, alpha=0.0625, alpha2=0.0, beta=0.0, gamma=0.0, delta=0.0,
                          kv_blocks=64, block_size=4, max_seqs=4, max_tokens=64,
                          chunked_prefill=True, watermark=0.0, queue_cap=4)
    # Prefill of 8 tokens: 0.5 + 0.5 = 1.0 s; the third request arrives exactly then.
    arrival = np.array([0.0, 0.0, 1.0, 1.0])
    prompt = np.array([8, 8, 8, 8])
    output = np.array([2, 2, 2, 1])
    got, want = run_both([prof], arrival, prompt, output, np.zeros(4, int), max_seqs=4)
    assert_same(got, want)
    # Both first prefills ride one iteration (16 tokens: 0.5 + 1.0 = 1.5 s).
    np.testing.assert_array_equal(got["first_token"][:2], [1.5, 1.5])


def test_single_request_closed_form():
    c0, alpha, alpha2, beta, gamma, delta = 0.25, 2 ** -6, 2 ** -10, 0.125, 2 ** -5, 2 ** -9
    p, o, k = 40, 6, 16

    def single(chunked):
        prof = ReplicaProfile(c0=c0, alpha=alpha, alpha2=alpha2, beta=beta, gamma=gamma,
                              delta=delta, kv_blocks=64, block_size=4, max_seqs=4,
                              max_tokens=k if chunked else 64, chunked_prefill=chunked,
                              watermark=0.0, queue_cap=4)
        env, params = env_for([prof], max_seqs=4)
        return jaxserve.replay(env, params, jaxserve.Trace([0.0], [p], [o]), actions=[0])

    decode = sum(c0 + alpha + beta + gamma + delta * (p + g) for g in range(1, o))
    whole = c0 + alpha * p + alpha2 * p * p
    got = single(False)
    assert got["first_token"][0] == whole and got["finish"][0] == whole + decode
    chunks, comp = 0.0, 0
    while comp < p:  # prefill in chunks of at most K tokens
        n = min(k, p - comp)
        chunks += c0 + alpha * n + alpha2 * n * (comp + n)
        comp += n
    got = single(True)
    assert got["first_token"][0] == chunks and got["finish"][0] == chunks + decode


def test_preemption_victim_is_last_admitted():
    """Two requests fill a 4-block cache; decoding needs a fifth block: the later one is
    preempted (recomputed later), the earlier one is not."""
    prof = ReplicaProfile(c0=0.5, alpha=0.0625, kv_blocks=4, block_size=4, max_seqs=4,
                          max_tokens=64, chunked_prefill=True, watermark=0.0, queue_cap=4)
    arrival, prompt, output = np.array([0.0, 0.0]), np.array([7, 7]), np.array([4, 4])
    got, want = run_both([prof], arrival, prompt, output, np.zeros(2, int), max_seqs=4)
    assert_same(got, want)
    np.testing.assert_array_equal(got["preemptions"], [0, 1])
    assert got["finish"][0] < got["finish"][1]


def test_max_seqs_one_is_mg1():
    """`max_seqs = 1`, no chunking: one request at a time, FCFS, service time fixed by its
    tokens, so Poisson arrivals give an M/G/1 queue. Mean wait (admission minus arrival) against
    Pollaczek-Khinchine `lambda E[S^2] / (2 (1 - rho))` at rho ~ 0.6, 6000 requests: the
    relative error of a waiting-time mean over this many M/G/1 requests is a few percent
    (batch-means estimate below); we allow 15%."""
    c0, alpha, beta, delta = 0.01, 1e-4, 0.002, 1e-6
    prof = ReplicaProfile(c0=c0, alpha=alpha, beta=beta, delta=delta, kv_blocks=4096,
                          block_size=16, max_seqs=1, max_tokens=4096, chunked_prefill=False,
                          watermark=0.0, queue_cap=256)
    rng = np.random.default_rng(3)
    n = 6000
    prompt = rng.integers(1, 400, size=n)
    output = rng.integers(1, 20, size=n)
    prefill = c0 + alpha * prompt
    decodes = np.array([sum(c0 + alpha + beta + delta * (p + g) for g in range(1, o))
                        for p, o in zip(prompt, output)])
    service = prefill + decodes
    lam = 0.6 / service.mean()
    arrival = np.cumsum(rng.exponential(1.0 / lam, size=n))
    env, params = env_for([prof], queue_buffer=256, max_seqs=1)
    got = jaxserve.replay(env, params, jaxserve.Trace(arrival, prompt, output),
                          actions=np.zeros(n, int))
    assert not got["dropped"].any()
    np.testing.assert_allclose(got["finish"] - got["first_token"], decodes, rtol=1e-4,
                               atol=1e-4)
    wait = got["first_token"] - prefill - arrival
    rho = lam * service.mean()
    pk = lam * np.mean(service ** 2) / (2 * (1 - rho))
    batch_means = wait[: n // 20 * 20].reshape(20, -1).mean(1)
    stderr = batch_means.std(ddof=1) / math.sqrt(20)
    assert stderr < 0.1 * pk  # the tolerance below is several standard errors
    assert abs(wait.mean() - pk) < 0.15 * pk, (wait.mean(), pk, stderr)


def test_conservation_and_invariants_every_step():
    """Stepping LLMRouting-v0 under overload with a tiny KV cache: at every step
    arrived = completed + waiting + running + dropped, the KV cache is never over-committed,
    running plus preempted-waiting never exceeds max_seqs, and fresh waiting <= queue_cap."""
    prof = [replica_profile("opt13b-a100-80g", kv_blocks=200, max_seqs=8, queue_cap=6),
            replica_profile("opt13b-a100-40g", kv_blocks=120, max_seqs=8, queue_cap=6,
                            chunked_prefill=False)]
    env, params = jaxserve.make("LLMRouting-v0", replicas=prof, arrival_rate=40.0,
                                max_steps_in_episode=10_000)
    _, state = env.reset(jax.random.PRNGKey(0), params)

    def step(carry, k):
        state, tot = carry
        k_a, k_s = jax.random.split(k)
        a = jax.random.randint(k_a, (), 0, 2)
        _, state, _, _, info = env.step_env(k_s, state, a, params)
        tot = tot + jnp.stack([info["arrived"], info["completed"], info["dropped"],
                               info["preemptions"]])
        c = state.cluster
        row = jnp.concatenate([tot, jnp.stack([c.queues.count.sum(), c.run.count.sum()]),
                               CB.kv_used(c, params.gpus), c.run.count + c.q_preempted,
                               c.queues.count - c.q_preempted])
        return (state, tot), row

    _, rows = jax.jit(lambda s, ks: jax.lax.scan(step, (s, jnp.zeros(4, jnp.int32)), ks))(
        state, jax.random.split(jax.random.PRNGKey(1), 600))
    rows = np.asarray(rows)
    arrived, completed, dropped, preempted, waiting, running = rows[:, :6].T
    np.testing.assert_array_equal(arrived, completed + waiting + running + dropped)
    assert dropped[-1] > 0 and preempted[-1] > 0 and completed[-1] > 0
    assert np.all(rows[:, 6:8] <= np.array([200, 120]))
    assert np.all(rows[:, 8:10] <= 8) and np.all(rows[:, 10:12] <= 6)


def test_reference_conserves_requests():
    rng = np.random.default_rng(2)
    arrival, prompt, output = dyadic_workload(rng)
    profiles = [dyadic_replica(rng, True, 0.0, kv_blocks=12) for _ in range(2)]
    seen = []

    def check(t, arrived, completed, waiting, running, dropped):
        seen.append(t)
        assert arrived == completed + waiting + running + dropped

    ref.simulate(arrival, prompt, output, rng.integers(0, 2, size=N_REQ), as_dicts(profiles),
                 check=check)
    assert len(seen) > N_REQ


def test_profiles_and_validation():
    prof = replica_profile("opt13b-a100-80g")
    assert prof.kv_blocks == kv_blocks_for(40, 5120, 80.0, 25.7) == 3379
    assert replica_profile("opt13b-a100-40g").kv_blocks == 633
    # A decode-only iteration of B sequences reproduces DistServe's decode fit (ms).
    b, ctx = 8, 8 * 600
    t = prof.c0 + prof.beta + (prof.alpha + prof.gamma) * b + prof.delta * ctx
    assert abs(t * 1e3 - (19.93 + 6.27e-4 * ctx + 0.0385 * b)) < 1e-9
    stacked = stack_replicas([prof, prof])
    assert stacked.kv_blocks.shape == (2,) and stacked.chunked_prefill.dtype == jnp.bool_
    with pytest.raises(ValueError, match="gamma must be >= -alpha"):
        validate_replica(ReplicaProfile(alpha=1e-4, gamma=-1e-3))
    with pytest.raises(ValueError, match=r"block_size must be in \[1, "):
        validate_replica(ReplicaProfile(block_size=0))
    with pytest.raises(ValueError, match="watermark"):
        validate_replica(ReplicaProfile(watermark=1.0))
    with pytest.raises(ValueError, match="unknown replica profile"):
        replica_profile("nope")
    with pytest.raises(ValueError, match="max_seqs"):
        env_for([ReplicaProfile(max_seqs=8)], max_seqs=4)


def test_ttft_tpot_goodput():
    from jaxserve.evaluation.llm_metrics import request_metrics, slo_attainment

    res = {"arrival": np.array([0.0, 1.0, 2.0, 3.0]),
           "first_token": np.array([0.5, 2.0, np.nan, 3.25]),
           "finish": np.array([2.5, 2.0, np.nan, 4.25]),
           "dropped": np.array([False, False, True, False])}
    out = np.array([5, 1, 3, 2])
    m = request_metrics(res, out)
    np.testing.assert_array_equal(m["ttft"][[0, 1, 3]], [0.5, 1.0, 0.25])
    np.testing.assert_array_equal(m["tpot"][[0, 3]], [0.5, 1.0])
    assert np.isnan(m["tpot"][1]) and np.isnan(m["e2e"][2])
    s = slo_attainment(res, out, slo_ttft=0.75, slo_tpot=0.5)
    np.testing.assert_array_equal(s["met"], [True, False, False, False])
    assert s["attainment"] == 0.25 and s["span_s"] == 4.25 and s["goodput"] == 1 / 4.25


def drain_case(seed=0):
    """One replica (max_seqs 4, max_tokens 256, chunked prefill, ~30 ms iterations with
    coefficients that are not dyadic) draining 60 requests that all arrive at t = 0: one
    decision window of > 2,000 iterations with no arrival in between (the hard case for the
    clock's float32 precision: thousands of iteration times added up within one window).
    No `delta`: decode iterations of a full batch all last the same, so a float32 running sum
    rounds the same way at every addition within a binade and its error grows linearly."""
    rng = np.random.default_rng(seed)
    prof = ReplicaProfile(c0=0.0291, alpha=3.1e-5, alpha2=1.3e-8, beta=1.7e-3, gamma=2.3e-5,
                          delta=0.0, kv_blocks=2000, block_size=16, max_seqs=4,
                          max_tokens=256, chunked_prefill=True, watermark=0.01, queue_cap=64)
    n = 60
    arrival = np.zeros(n)
    prompt = rng.integers(1, 400, size=n)
    output = rng.integers(100, 200, size=n)
    return prof, arrival, prompt, output


def test_clock_precision_over_a_long_drain():
    """First-token and finish times within 1e-4 s + 2e-6 x t of the float64 reference over a
    drain of > 2,000 iterations. A float32 running sum of these iteration times ends ~9.7e-4 s
    off at 72 s (4.4x the tolerance; each addition rounds by up to half an ulp of the clock,
    3.8e-6 s at 64 s, here with a bias); the compensated clock keeps only the rounding of each
    iteration time (float32, relative ~6e-8) and of the stored sum."""
    prof, arrival, prompt, output = drain_case()
    got, want = run_both([prof], arrival, prompt, output, np.zeros(len(arrival), int),
                         queue_buffer=64, max_seqs=4)
    assert want["iterations"][0] >= 2000 and want["finish"].max() > 60.0
    assert not want["dropped"].any()
    for key in ("first_token", "finish"):
        err = np.abs(got[key] - want[key])
        assert np.all(err <= 1e-4 + 2e-6 * want[key]), (key, err.max())


def drain_engine(profiles, prompt, output, replica, decode_runs=True, queue_buffer=16,
                 max_seqs=4):
    """Routes requests that all arrive at t = 0, then drains the replicas with one `advance`.

    Returns (per-request first-token and finish times as numpy arrays, replicas, extras)."""
    from jaxserve.core import queues as Q

    prof = stack_replicas(profiles)
    n = len(prompt)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    reqs = Q.Request(arrival=f32(np.zeros(n)), prompt=f32(prompt), output=f32(output),
                     estimate=f32(output), size_class=jnp.zeros(n, jnp.int32),
                     req_id=jnp.arange(n, dtype=jnp.int32))

    @jax.jit
    def go(reqs, replica):
        rep = CB.empty_replicas(len(profiles), queue_buffer, max_seqs)

        def push(rep, x):
            req, r = x
            rep, _, _ = CB.route(rep, prof, req, r)
            return rep, None

        rep, _ = jax.lax.scan(push, rep, (reqs, replica))
        rep, _, ex, log = CB.advance(rep, prof, jnp.inf, jnp.inf, CB.empty_log(n), decode_runs)
        return rep, ex, log

    rep, ex, log = go(reqs, jnp.asarray(replica, jnp.int32))
    return (np.asarray(log.ttft, np.float64), np.asarray(log.e2e, np.float64),
            np.asarray(log.preemptions)), rep, ex


def test_decode_runs_are_skipped_exactly():
    """Long outputs on the dyadic grid: most iterations are pure decodes, skipped in closed
    form (far fewer boundary passes than iterations), and every first-token time, finish
    time, preemption count and per-replica counter equals the reference and the engine that
    runs every boundary. Replica 0's cache is tight enough that some runs end at the KV
    limit (preemptions); here 33 boundary passes against 149 without the skip."""
    rng = np.random.default_rng(7)
    n = 24
    prompt = rng.integers(1, 24, size=n)
    output = rng.integers(20, 60, size=n)
    replica = rng.integers(0, 2, size=n)
    profiles = [dyadic_replica(rng, True, 0.0, kv_blocks=kv, queue_cap=16) for kv in (48, 96)]
    want = ref.simulate(np.zeros(n), prompt, output, replica, as_dicts(profiles))
    (ttft, e2e, pre), rep, ex = drain_engine(profiles, prompt, output, replica)
    (ttft0, e2e0, pre0), rep0, ex0 = drain_engine(profiles, prompt, output, replica,
                                                  decode_runs=False)
    for got_t, got_e, got_p in ((ttft, e2e, pre), (ttft0, e2e0, pre0)):
        np.testing.assert_array_equal(got_t, want["first_token"])
        np.testing.assert_array_equal(got_e, want["finish"])
        np.testing.assert_array_equal(got_p, want["preemptions"])
    assert want["replica_preemptions"][0] > 0  # a run ended at the KV limit
    for r in (rep, rep0):
        np.testing.assert_array_equal(r.iterations, want["iterations"])
        np.testing.assert_array_equal(r.preemptions, want["replica_preemptions"])
        np.testing.assert_array_equal(r.kv_peak, want["kv_peak"])
        np.testing.assert_allclose(r.busy, want["busy"], rtol=1e-6)
        np.testing.assert_allclose(r.kv_block_s, want["kv_block_s"], rtol=1e-6)
    # Every iteration is one boundary pass without the skip (plus the final pass, which ends
    # the last iterations and schedules nothing); with it, far fewer.
    assert int(ex0["boundaries"]) >= want["iterations"].max()
    assert int(ex["boundaries"]) < want["iterations"].max() // 3, (ex["boundaries"],
                                                                 want["iterations"])


def _one_replica_state(prof, running, waiting, max_seqs=4):
    """A replica at an iteration boundary with `running` [(prompt, output, gen)] decoding
    (every sampled token but the last computed) and `waiting` [(prompt, output)] fresh."""
    from jaxserve.core import queues as Q

    p1 = stack_replicas([prof])
    rep = CB.empty_replicas(1, 8, max_seqs)
    for i, (p, o) in enumerate(waiting):
        req = Q.Request(arrival=jnp.float32(0.0), prompt=jnp.float32(p), output=jnp.float32(o),
                        estimate=jnp.float32(o), size_class=jnp.int32(0), req_id=jnp.int32(i))
        rep, dropped, _ = CB.route(rep, p1, req, jnp.int32(0))
        assert not bool(dropped)
    k = len(running)
    pad = lambda v: jnp.asarray([list(v) + [0] * (max_seqs - k)], jnp.int32)  # noqa: E731
    p, o, g = (pad(c) for c in zip(*running))
    run = rep.run.replace(prompt=p, output=o, gen=g, comp=p + g - 1,
                          count=jnp.asarray([k], jnp.int32))
    return rep.replace(run=run), p1


def _skipped(rep, prof, horizon=np.inf):
    zero = jnp.zeros((1,), jnp.float32)
    out, *_ = decode_run(rep, prof, jnp.asarray([True]), zero, zero,
                             jnp.float32(horizon))
    return int(out.iterations[0])


def test_decode_run_stops_where_the_schedule_changes():
    """The skipped run's length: up to (not including) the first completion, the KV limit and
    the horizon; none when the waiting head could be admitted or a decode must preempt."""
    prof = ReplicaProfile(c0=0.5, alpha=0.0625, kv_blocks=64, block_size=4, max_seqs=4,
                          max_tokens=64, chunked_prefill=True, watermark=0.0, queue_cap=4)
    # Two decodes with 9 and 5 tokens left: the first completion ends iteration 5.
    rep, p1 = _one_replica_state(prof, [(6, 10, 1), (3, 8, 3)], [])
    assert _skipped(rep, p1) == 4
    # Iterations last 0.5 + 2 * 0.0625 = 0.625 s: 3 end by 2.0 s.
    assert _skipped(rep, p1, horizon=2.0) == 3
    # A run ending exactly at the horizon (3 x 0.625 s): its last end is processed and nothing
    # starts at the horizon (MODEL.md event order), as when every boundary runs.
    for runs in (True, False):
        out, _, ex, _ = CB.advance(rep, p1, jnp.float32(1.875), jnp.float32(jnp.inf), None,
                                   runs)
        assert int(out.iterations[0]) == 3 and not bool(out.in_iter[0])
        assert float(out.t_end[0]) == 1.875 and int(out.run.gen[0, 0]) == 4
    # Admission possible (a free seat, budget and blocks): no skip.
    rep_w, p1 = _one_replica_state(prof, [(6, 10, 1), (3, 8, 3)], [(4, 2)])
    assert _skipped(rep_w, p1) == 0
    # The same head cannot be admitted when the seats are full: the run is skipped.
    full = [(6, 10, 1), (3, 8, 3), (2, 9, 1), (2, 9, 1)]
    rep_f, p1 = _one_replica_state(prof, full, [(4, 2)])
    assert _skipped(rep_f, p1) == 4
    # KV-bound: 5 blocks of 4 tokens, ceil(6/4) + ceil(5/4) = 4 held. The first request
    # needs a third block to compute token 9 (its 3rd iteration), the second at its 4th, which
    # would preempt: 3 iterations are skipped.
    tight = prof.replace(kv_blocks=5)
    rep_k, p1 = _one_replica_state(tight, [(6, 10, 1), (3, 8, 3)], [])
    assert _skipped(rep_k, p1) == 3
    # A preemption due at the first boundary (4 blocks, all held; C = 8 needs a new one).
    rep_p, p1 = _one_replica_state(prof.replace(kv_blocks=4), [(6, 10, 3), (3, 8, 3)], [])
    assert _skipped(rep_p, p1) == 0


def test_decode_run_kv_bound_equals_brute_force():
    """The run's KV bound is found in closed form (the (e+1)-th smallest block crossing, by
    halving over one block): on random decoding sets, block sizes 1-16 and free blocks 0-6,
    alone and vmapped together (mixed block sizes: the halving's trip count is the batch's),
    the skipped run is the largest k below the first completion whose extra blocks
    `sum ceil((C_i + k) / b) - ceil(C_i / b)` fit the free blocks, counted one k at a time."""
    rng = np.random.default_rng(21)
    reps, profs, want, kv_bound = [], [], [], 0
    for _ in range(48):
        b = int(rng.choice([1, 2, 4, 8, 16]))
        running = [(int(rng.integers(1, 40)), 0, 0) for _ in range(int(rng.integers(1, 5)))]
        running = [(p, int(rng.integers(100, 400)), 0) for p, _, _ in running]
        running = [(p, o, int(rng.integers(1, 40))) for p, o, _ in running]
        comp = np.asarray([p + g - 1 for p, _, g in running])
        held = int(np.ceil(comp / b).sum())
        free = int(rng.integers(0, 7))
        prof = ReplicaProfile(c0=0.5, alpha=0.0625, kv_blocks=held + free, block_size=b,
                              max_seqs=4, max_tokens=64, chunked_prefill=True, watermark=0.0,
                              queue_cap=4)
        rep, p1 = _one_replica_state(prof, running, [])
        left = min(o - g for _, o, g in running)
        k = 0
        while k + 1 < left and int(np.ceil((comp + k + 1) / b).sum()) - held <= free:
            k += 1
        assert _skipped(rep, p1) == k
        kv_bound += k + 1 < left
        reps.append(rep), profs.append(p1), want.append(k)
    stack = lambda xs: jax.tree.map(lambda *x: jnp.stack(x), *xs)  # noqa: E731
    zero = jnp.zeros((1,), jnp.float32)
    out = jax.jit(jax.vmap(lambda r, p: decode_run(r, p, jnp.asarray([True]), zero, zero,
                                                       jnp.float32(np.inf))[0].iterations))(
        stack(reps), stack(profs))
    np.testing.assert_array_equal(np.asarray(out)[:, 0], want)
    assert kv_bound >= 40  # the blocks, not a completion, end nearly every run


def test_block_arithmetic_is_exact_integer_division():
    """`div`, `mod`, `cdiv` (float32 division plus one integer correction) equal integer
    floor division for every dividend the engine can form (token counts up to 2^24 per
    request, plus a block less one) over every divisor used as a block size, at the edges where
    a float32 quotient rounds: exact multiples, one below and above them, and the top of the
    range where float32 no longer holds every integer (2^24 + 1 rounds to 2^24), up to 2^25."""
    rng = np.random.default_rng(5)
    bs = np.asarray([1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 64, 100, 255, 256, 4096])
    top = 2 ** 25  # `div`'s stated range
    a = np.concatenate([rng.integers(0, top, 20000), np.arange(0, 300),
                        np.arange(2 ** 24 - 300, 2 ** 24 + 4096, 7),
                        np.arange(top - 300, top)]).astype(np.int64)
    for b in bs:
        mult = (a // b) * b
        edge = np.clip(np.concatenate([a, mult - 1, mult + 1, mult]), 0, top).astype(np.int32)
        want_div, want_mod = edge // b, edge % b
        got_div = np.asarray(jax.jit(N.div)(jnp.asarray(edge), jnp.int32(b)))
        got_mod = np.asarray(jax.jit(N.mod)(jnp.asarray(edge), jnp.int32(b)))
        np.testing.assert_array_equal(got_div, want_div, err_msg=f"b={b}")
        np.testing.assert_array_equal(got_mod, want_mod, err_msg=f"b={b}")
        small = edge[edge <= 2 ** 24]
        np.testing.assert_array_equal(np.asarray(jax.jit(N.cdiv)(small, jnp.int32(b))),
                                      -(-small // b), err_msg=f"b={b}")
    # Per-row divisors, as the engine passes them (one block size per replica).
    rows = jnp.asarray(rng.integers(0, 2 ** 24, (16, 64)), jnp.int32)
    b_row = jnp.asarray(rng.choice(bs, (16, 1)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(N.div(rows, b_row)),
                                  np.asarray(rows) // np.asarray(b_row))


def test_cumsum_and_rowsum():
    """`cumsum` (shifted adds) is the inclusive prefix sum at every width, powers of two or
    not; `rowsum` (a product with ones) is the row sum up to float32 rounding."""
    rng = np.random.default_rng(6)
    for n in (1, 2, 3, 5, 16, 63, 64, 65, 192):
        x = rng.integers(-1000, 1000, (3, 4, n)).astype(np.int32)
        np.testing.assert_array_equal(np.asarray(N.cumsum(jnp.asarray(x))), np.cumsum(x, -1))
        f = rng.standard_normal((3, n)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(CB.rowsum(jnp.asarray(f))), f.sum(-1),
                                   rtol=1e-5, atol=1e-5 * n)


def test_decode_runs_vmap_equals_loop():
    """vmap over replica sets (different caches, hence different runs) equals each alone."""
    rng = np.random.default_rng(8)
    n = 16
    prompt, output = rng.integers(1, 24, size=n), rng.integers(10, 40, size=n)
    replica = np.zeros(n, int)
    lanes = [dyadic_replica(np.random.default_rng(s), True, 0.0, kv_blocks=kv, queue_cap=16)
             for s, kv in ((1, 12), (2, 20), (3, 64))]
    singles = [drain_engine([p], prompt, output, replica)[0] for p in lanes]
    from jaxserve.core import queues as Q

    profs = jax.tree.map(lambda *x: jnp.stack(x), *[stack_replicas([p]) for p in lanes])
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    reqs = Q.Request(arrival=f32(np.zeros(n)), prompt=f32(prompt), output=f32(output),
                     estimate=f32(output), size_class=jnp.zeros(n, jnp.int32),
                     req_id=jnp.arange(n, dtype=jnp.int32))

    def one(prof):
        rep = CB.empty_replicas(1, 16, 4)
        rep, _ = jax.lax.scan(lambda r, q: (CB.route(r, prof, q, jnp.int32(0))[0], None),
                              rep, reqs)
        _, _, _, log = CB.advance(rep, prof, jnp.inf, jnp.inf, CB.empty_log(n))
        return log

    logs = jax.jit(jax.vmap(one))(profs)
    for i, (ttft, e2e, pre) in enumerate(singles):
        np.testing.assert_array_equal(np.asarray(logs.ttft[i], np.float64), ttft)
        np.testing.assert_array_equal(np.asarray(logs.e2e[i], np.float64), e2e)
        np.testing.assert_array_equal(np.asarray(logs.preemptions[i]), pre)


def test_decode_run_length_at_any_horizon_equals_every_boundary():
    """The skipped run's length comes from the horizon's closed-form root (checked at its
    neighbours) or, where that does not settle it, the binary search: at every horizon the
    skip runs exactly the iterations the every-boundary engine runs, and ends at its time."""
    prof = ReplicaProfile(c0=0.5, alpha=0.0625, delta=2.0 ** -9, kv_blocks=64, block_size=4,
                          max_seqs=4, max_tokens=64, chunked_prefill=True, watermark=0.0,
                          queue_cap=4)
    rep, p1 = _one_replica_state(prof, [(6, 40, 1), (3, 38, 3)], [])
    horizons = jnp.asarray(np.linspace(0.05, 30.0, 97), jnp.float32)

    def run(h, runs):
        out, _, ex, _ = CB.advance(rep, p1, h, jnp.float32(jnp.inf), None, runs)
        return out.iterations[0], out.t_end[0], out.run.gen[0], ex["boundaries"]

    it1, t1, g1, b1 = jax.jit(jax.vmap(lambda h: run(h, True)))(horizons)
    it0, t0, g0, b0 = jax.jit(jax.vmap(lambda h: run(h, False)))(horizons)
    np.testing.assert_array_equal(it1, it0)
    np.testing.assert_array_equal(g1, g0)
    np.testing.assert_allclose(t1, t0, rtol=1e-6)
    assert int(b1.max()) <= 4 < int(b0.max())  # the skip did run


def test_replica_lanes_equal_the_logged_loop():
    """`advance` without a request log runs one loop lane per replica (`_replica_lanes`, what
    the environments run); with one (replay) one lane per cluster, which the tests above hold
    to the reference per request. Both must reach bit-identical replicas after every window,
    with the same boundary-pass counts, vmapped over 48 environments of 4 replicas (192 lanes:
    past `lanes.MIN_COMPACT_LANES`, so the dense phase and the compact chunks both run; one
    environment alone runs the lanes as a plain masked loop, which
    `test_per_replica_counters_match_reference` holds to the reference). Float metrics are
    sums in another order: equal to 1e-6 relative."""
    from jaxserve.core import queues as Q

    rng = np.random.default_rng(11)
    profiles = [ReplicaProfile(
        c0=rng.uniform(0.005, 0.02), alpha=rng.uniform(1e-5, 1e-4), beta=rng.uniform(0, 2e-3),
        gamma=rng.uniform(0, 1e-4), delta=rng.uniform(0, 1e-6),
        kv_blocks=int(rng.integers(30, 60)), block_size=16, max_seqs=8,
        max_tokens=int(rng.choice([256, 512])), chunked_prefill=bool(g % 2), watermark=0.01,
        queue_cap=8) for g in range(4)]
    prof = stack_replicas(profiles)
    n, envs = 40, 48
    gaps = rng.exponential(0.08, size=(envs, n)).astype(np.float32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    prompt = f32(rng.integers(1, 300, size=(envs, n)))
    output = f32(rng.integers(1, 80, size=(envs, n)))
    replica = jnp.asarray(rng.integers(0, 4, size=(envs, n)), jnp.int32)

    def episode(gap, prompt, output, replica, logged):
        rep = CB.empty_replicas(4, 8, 8)
        log = CB.empty_log(n if logged else 0)

        def step(c, x):
            rep, log = c
            g, p, o, r, i = x
            req = Q.Request(arrival=jnp.float32(0.0), prompt=p, output=o, estimate=o,
                            size_class=jnp.int32(0), req_id=i)
            rep, _, _ = CB.route(rep, prof, req, r)
            rep, m, ex, log = CB.advance(rep, prof, g, jnp.float32(1.0), log)
            return (CB.rebase(rep, g), log), (rep, m, ex)

        xs = (gap, prompt, output, replica, jnp.arange(n, dtype=jnp.int32))
        return jax.lax.scan(step, (rep, log), xs)[1]

    def check(got, want):
        rep_g, m_g, ex_g = got
        rep_w, m_w, ex_w = want
        assert rep_g.preemptions.sum() > 0 and rep_g.run.count.max() > 1
        for a, b in zip(jax.tree.leaves(rep_g), jax.tree.leaves(rep_w)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves((m_g, ex_g)), jax.tree.leaves((m_w, ex_w))):
            if jnp.issubdtype(a.dtype, jnp.integer):  # counts, boundary passes included
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    run = jax.jit(jax.vmap(episode, in_axes=(0, 0, 0, 0, None)), static_argnums=4)
    check(run(gaps, prompt, output, replica, False), run(gaps, prompt, output, replica, True))
