"""The JAX engine against the pure-Python event-by-event reference (`jaxserve/reference/sim.py`).

Two kinds of workload:
- a dyadic grid: arrival times on multiples of 1/4 s and service coefficients that are powers
  of two, so every time is exactly representable in float32 and float64 alike. Ties between
  arrivals, completions and deadlines are then frequent and must be broken exactly as MODEL.md
  says; the engine must match the reference *exactly*.
- continuous random workloads: matched to float32 round-off of the spans involved.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.core.sources import trace_arrays
from jaxserve.reference import sim as ref


def profile_dicts(profiles):
    return [{k: getattr(p, k) for k in ref.PROFILE_KEYS} for p in profiles]


def dyadic_profiles(rng, n, max_batch, timeouts):
    out = []
    for g in range(n):
        out.append(jaxserve.GPUProfile(
            c0=float(rng.choice([0.0, 0.25, 0.5])), alpha=2.0 ** -int(rng.integers(6, 10)),
            alpha2=float(rng.choice([0.0, 2.0 ** -14])), beta=2.0 ** -int(rng.integers(2, 5)),
            gamma=float(rng.choice([0.0, 2.0 ** -6])), delta=float(rng.choice([0.0, 2.0 ** -12])),
            max_batch=int(max_batch[g]), queue_cap=int(rng.integers(1, 6)),
            timeout=float(timeouts[g])))
    return out


def run_both(profiles, arrival, prompt, output, gpu):
    env, params = jaxserve.make("Routing-v0", gpus=profiles)
    trace = jaxserve.Trace(arrival, prompt, output)
    got = jaxserve.replay(env, params, trace, actions=gpu)
    want = ref.simulate(arrival, prompt, output, gpu, profile_dicts(profiles))
    return got, want


def assert_same_schedule(got, want, atol):
    np.testing.assert_array_equal(got["dropped"], want["dropped"])
    ok = ~want["dropped"]
    np.testing.assert_allclose(got["start"][ok], want["start"][ok], rtol=0, atol=atol)
    np.testing.assert_allclose(got["finish"][ok], want["finish"][ok], rtol=0, atol=atol)
    assert np.all(np.isnan(got["start"][~ok])) and np.all(np.isnan(got["finish"][~ok]))
    # The same partition of requests into batches (ids in the same order too).
    np.testing.assert_array_equal(got["batch"], want["batch"])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_batch", [1, 4, 16])
def test_dyadic_grid_matches_reference_exactly(seed, max_batch):
    rng = np.random.default_rng(1000 * seed + max_batch)
    n, num_gpus = 160, 3
    # Arrivals on a coarse 1/4 s grid, often several per instant.
    arrival = np.cumsum(rng.choice([0.0, 0.0, 0.25, 0.5, 1.0], size=n))
    prompt = rng.integers(1, 64, size=n)
    output = rng.integers(1, 24, size=n)
    timeouts = rng.choice([0.0, 0.5, 2.0], size=num_gpus)
    profiles = dyadic_profiles(rng, num_gpus, [max_batch] * num_gpus, timeouts)
    gpu = rng.integers(0, num_gpus, size=n)
    got, want = run_both(profiles, arrival, prompt, output, gpu)
    assert want["dropped"].any() or seed % 2  # tiny queues: drops do happen
    assert_same_schedule(got, want, atol=0.0)


@pytest.mark.parametrize("seed", range(4))
def test_continuous_random_workloads_match_reference(seed):
    rng = np.random.default_rng(seed)
    n, num_gpus = 400, 4
    arrival = np.cumsum(rng.exponential(0.3, size=n))
    prompt = rng.integers(1, 2000, size=n)
    output = rng.integers(1, 400, size=n)
    profiles = [jaxserve.GPUProfile(
        c0=rng.uniform(0, 0.05), alpha=rng.uniform(0, 2e-4), alpha2=rng.uniform(0, 1e-8),
        beta=rng.uniform(0.005, 0.03), gamma=rng.uniform(0, 1e-3), delta=rng.uniform(0, 1e-6),
        max_batch=int(rng.choice([1, 4, 16])), queue_cap=int(rng.integers(2, 40)),
        timeout=float(rng.choice([0.0, rng.uniform(0, 2)]))) for _ in range(num_gpus)]
    gpu = rng.integers(0, num_gpus, size=n)
    got, want = run_both(profiles, arrival, prompt, output, gpu)
    # Spans here are < 1e3 s; float32 keeps them to ~1e-4 s.
    assert_same_schedule(got, want, atol=1e-3)


@pytest.mark.slow
def test_million_arrivals_stay_exact_in_float32():
    """10^6 arrivals over ~5e5 s: absolute float32 times would be off by ~0.03 s; the rebased
    clock keeps every request's wait and service to float32 precision of the spans."""
    rng = np.random.default_rng(7)
    n = 1_000_000
    arrival = np.cumsum(rng.exponential(0.5, size=n))
    prompt = rng.integers(1, 1024, size=n)
    output = rng.integers(1, 64, size=n)
    profiles = [jaxserve.GPUProfile(c0=0.02, alpha=1e-4, beta=0.01, gamma=1e-3, max_batch=4,
                                    queue_cap=8, timeout=0.1),
                jaxserve.GPUProfile(c0=0.03, alpha=2e-4, beta=0.02, gamma=1e-3, max_batch=8,
                                    queue_cap=8, timeout=0.0)]
    gpu = rng.integers(0, 2, size=n)
    assert arrival[-1] > 4e5
    got, want = run_both(profiles, arrival, prompt, output, gpu)
    np.testing.assert_array_equal(got["dropped"], want["dropped"])
    ok = ~want["dropped"]
    # Errors are relative to the spans (waits and services of seconds), not to the clock.
    np.testing.assert_allclose(got["start"][ok] - got["arrival"][ok],
                               want["start"][ok] - arrival[ok], rtol=0, atol=1e-4)
    np.testing.assert_allclose(got["finish"][ok], want["finish"][ok], rtol=0, atol=1e-4)


def batching_decide(threshold):
    def decide(now, arrivals, prompts, outputs):
        return len(arrivals) if len(arrivals) >= threshold else 0
    return decide


@pytest.mark.parametrize("threshold", [1, 3])
def test_batching_env_matches_reference(threshold):
    rng = np.random.default_rng(threshold)
    n = 200
    arrival = np.cumsum(rng.choice([0.0, 0.25, 0.5, 0.75], size=n))
    prompt = rng.integers(1, 64, size=n)
    output = rng.integers(1, 16, size=n)
    prof = dyadic_profiles(rng, 1, [4], [0.0])[0].replace(queue_cap=6)
    want = ref.simulate_batching(arrival, prompt, output, profile_dicts([prof])[0],
                                 batching_decide(threshold))
    env, params = jaxserve.make("Batching-v0", gpus=[prof])
    tr = jaxserve.Trace(arrival, prompt, output)
    env = env.replace_static(trace_len=n, log_capacity=n)
    params = params.replace(trace=trace_arrays(tr))

    def policy(state):
        q = state.cluster.queues.count[0]
        return jnp.where(q >= threshold, q, 0)

    @jax.jit
    def run(key):
        _, state = env.reset_env(key, params)

        def step(state, k):
            _, state, _, term, info = env.step_env(k, state, policy(state), params)
            return state, (term, info["dropped"])
        return jax.lax.scan(step, state, jax.random.split(key, 2 * n))

    state, (term, dropped) = run(jax.random.PRNGKey(0))
    assert bool(term.any())
    log = state.log
    got_start = arrival + np.asarray(log.wait, np.float64)
    got_drop = np.isnan(np.asarray(log.wait))
    np.testing.assert_array_equal(got_drop, want["dropped"])
    ok = ~got_drop
    np.testing.assert_array_equal(got_start[ok], want["start"][ok])
    np.testing.assert_array_equal(got_start[ok] + np.asarray(log.service, np.float64)[ok],
                                  want["finish"][ok])


@pytest.mark.parametrize("path", ["compact", "dense", "loop"])
def test_vmapped_replays_match_reference_exactly_on_both_batched_paths(path, monkeypatch):
    """Under `vmap` the event loop is lane-compacted (`cluster._advance_lanes`, the CPU
    default) or dense (`cluster._advance_unrolled` vmapped, the GPU default); force each, run
    six dyadic workloads (different arrivals, sizes, routings and profiles) as one batch and
    require each to match the reference exactly, as the single-environment path does. A spy
    checks the forced path is the one traced."""
    import importlib

    from jaxserve.core import cluster as C
    from jaxserve.core import lanes
    taken = []
    spied = {"compact": "_advance_lanes", "dense": "_advance_unrolled", "loop": "_advance_dense"}
    for name in spied.values():
        fn = getattr(C, name)
        monkeypatch.setattr(C, name, lambda *a, _fn=fn, _n=name: taken.append(_n) or _fn(*a))
    monkeypatch.setattr(lanes, "engine_path", path)
    jax.clear_caches()  # the path is read at trace time: retrace under this one

    from jaxserve.evaluation.evaluate import trace_env
    R = importlib.import_module("jaxserve.evaluation.replay")  # the module, not the function

    n, num_gpus, batch = 120, 3, 6
    cases = []
    for seed in range(batch):
        rng = np.random.default_rng(500 + seed)
        arrival = np.cumsum(rng.choice([0.0, 0.0, 0.25, 0.5, 1.0], size=n))
        prompt = rng.integers(1, 64, size=n)
        output = rng.integers(1, 24, size=n)
        mb = rng.choice([1, 4, 16], size=num_gpus)
        profiles = dyadic_profiles(rng, num_gpus, mb, rng.choice([0.0, 0.5, 2.0], num_gpus))
        cases.append((profiles, arrival, prompt, output, rng.integers(0, num_gpus, size=n)))
    # One static configuration for all: the largest batch and queue of any case.
    big = [p.replace(max_batch=16, queue_cap=5) for p in cases[0][0]]
    env, _ = jaxserve.make("Routing-v0", gpus=big)
    env = trace_env(env, n)
    params = []
    for profiles, arrival, prompt, output, _ in cases:
        _, p = jaxserve.make("Routing-v0", gpus=profiles)
        params.append(p.replace(trace=trace_arrays(jaxserve.Trace(arrival, prompt,
                                                                         output))))
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *params)
    actions = jnp.asarray(np.stack([c[4] for c in cases]), jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(0), batch)
    run = jax.jit(jax.vmap(lambda k, p, a: R._run_actions(env, k, p, a)))
    log, dropped = run(keys, stacked, actions)
    for b, (profiles, arrival, prompt, output, gpu) in enumerate(cases):
        got = R.per_request_log(jaxserve.Trace(arrival, prompt, output), gpu,
                                jax.tree.map(lambda x: x[b], log), dropped[b])
        want = ref.simulate(arrival, prompt, output, gpu, profile_dicts(profiles))
        assert_same_schedule(got, want, atol=0.0)
    assert taken and set(taken) == {spied[path]}
    jax.clear_caches()

