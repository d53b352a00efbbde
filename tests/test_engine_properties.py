"""Property tests (hypothesis) of the engine's invariants over random parameters and actions.

Shapes are fixed (3 GPUs, queue buffer 8, max batch 8) so every example reuses one compiled
program; parameters and actions vary as traced values.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxserve
from jaxserve.core import queues as Q
from jaxserve.core.types import stack_profiles

NUM_GPUS, BUFFER, STEPS, TRACE_LEN = 3, 8, 60, 48
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

profile = st.builds(
    jaxserve.GPUProfile,
    c0=st.floats(0, 0.5), alpha=st.floats(0, 1e-3), alpha2=st.floats(0, 1e-7),
    beta=st.floats(0, 0.05), gamma=st.floats(0, 1e-2), delta=st.floats(0, 1e-5),
    max_batch=st.integers(1, BUFFER), queue_cap=st.integers(1, BUFFER),
    timeout=st.sampled_from([0.0, 0.1, 1.0, 5.0]))

ENV, BASE = jaxserve.make("Routing-v0", gpus=[jaxserve.GPUProfile(max_batch=BUFFER,
                                                                   queue_cap=BUFFER)] * NUM_GPUS,
                          max_steps_in_episode=10 ** 6)


def summaries_hold(cluster, params, p_max):
    """Whether `cluster.waiting` agrees with the queue slots it summarises (one environment).

    The stored head and batch-filling arrivals equal the slots' bit for bit where meaningful;
    the prompt sums match a fresh sum to float32 round-off; the running maximum bounds every
    waiting estimate; all three are exactly 0 on an empty queue. Round-off bound: a running
    sum sees at most 2 roundings per step (a push, and a dispatch's subtraction of its
    window's own float32 sum, itself off by at most `BUFFER` roundings), each at most 2^-24 of
    a value below `BUFFER * p_max^k` (`p_max`: the largest prompt of the episode so far), so
    it stays within `tol_k` over `STEPS` steps.
    """
    q, w = cluster.queues, cluster.waiting
    b = jnp.maximum(params.gpus.max_batch, 1)
    mask = Q.waiting_mask(q)
    p = jnp.where(mask, q.prompt, 0.0)
    first_ok = (q.count == 0) | (w.first == Q.stored_arrival_at(q, jnp.zeros_like(b)))
    full_ok = (q.count < b) | (w.full == Q.stored_arrival_at(q, jnp.minimum(b, BUFFER) - 1))
    big = BUFFER * p_max
    tol_1, tol_2 = (2 * STEPS + BUFFER) * 2.0 ** -24 * big * jnp.stack([1.0, big / BUFFER])
    sums_ok = ((jnp.abs(w.prompt_sum - p.sum(-1)) <= tol_1)
               & (jnp.abs(w.prompt_sq_sum - (p * p).sum(-1)) <= tol_2))
    max_ok = w.estimate_max >= jnp.where(mask, q.estimate, 0.0).max(-1)
    empty = q.count == 0
    zero_ok = ~empty | ((w.prompt_sum == 0) & (w.prompt_sq_sum == 0) & (w.estimate_max == 0))
    return jnp.all(first_ok & full_ok & sums_ok & max_ok & zero_ok)


@jax.jit
@partial(jax.vmap, in_axes=(None, 0))  # two environments: the batched (compacted) engine path
def accounting(params, key):
    """Per step: cumulative arrived, completed, dropped, the requests held in the system,
    whether reward and observation are finite, and whether `summaries_hold`."""
    _, state = ENV.reset_env(key, params)

    def step(carry, k):
        state, tot, p_max = carry
        p_max = jnp.maximum(p_max, state.pending.prompt)
        k_a, k_s = jax.random.split(k)
        a = jax.random.randint(k_a, (), -1, NUM_GPUS + 1)  # includes invalid actions
        _, state, r, _, info = ENV.step_env(k_s, state, a, params)
        tot = tot + jnp.stack([info["arrived"], info["completed"], info["dropped"]])
        held = (state.cluster.queues.count + state.cluster.servers.run_count).sum()
        finite = jnp.isfinite(r) & jnp.all(jnp.isfinite(ENV.get_obs(state, params)))
        return (state, tot, p_max), (tot, held, finite,
                                     summaries_hold(state.cluster, params, p_max))

    _, out = jax.lax.scan(step, (state, jnp.zeros(3, jnp.int32), jnp.float32(0.0)),
                          jax.random.split(key, STEPS))
    return out


def two_keys(seed):
    return jax.random.split(jax.random.PRNGKey(seed))


@SETTINGS
@given(gpus=st.lists(profile, min_size=NUM_GPUS, max_size=NUM_GPUS),
       rate=st.floats(0.05, 200.0), seed=st.integers(0, 2 ** 31 - 1))
def test_every_request_is_accounted_for_at_every_step(gpus, rate, seed):
    params = BASE.replace(gpus=stack_profiles(gpus),
                          arrivals=BASE.arrivals.replace(rates=jnp.asarray([rate], jnp.float32)))
    tot, held, finite, _ = accounting(params, two_keys(seed))
    tot, held = np.asarray(tot), np.asarray(held)
    # arrived = completed + waiting + running + dropped
    np.testing.assert_array_equal(tot[..., 0], tot[..., 1] + held + tot[..., 2])
    assert np.all(np.asarray(finite))


@SETTINGS
@given(gpus=st.lists(profile, min_size=NUM_GPUS, max_size=NUM_GPUS),
       rate=st.floats(0.05, 200.0), seed=st.integers(0, 2 ** 31 - 1))
def test_running_summaries_match_the_queue_slots(gpus, rate, seed):
    """`Cluster.waiting` (what the due test and the shaping potential read instead of the
    slots) stays equal to what the slots hold, through pushes, dispatches, rebases, drops."""
    params = BASE.replace(gpus=stack_profiles(gpus),
                          arrivals=BASE.arrivals.replace(rates=jnp.asarray([rate], jnp.float32)))
    *_, ok = accounting(params, two_keys(seed))
    assert np.all(np.asarray(ok))


@SETTINGS
@given(gpus=st.lists(profile, min_size=NUM_GPUS, max_size=NUM_GPUS),
       data=st.data())
def test_schedules_are_feasible(gpus, data):
    gaps = data.draw(st.lists(st.sampled_from([0.0, 0.01, 0.1, 0.5, 2.0]),
                              min_size=TRACE_LEN, max_size=TRACE_LEN))
    prompt = data.draw(st.lists(st.integers(1, 4000), min_size=TRACE_LEN, max_size=TRACE_LEN))
    output = data.draw(st.lists(st.integers(1, 500), min_size=TRACE_LEN, max_size=TRACE_LEN))
    actions = data.draw(st.lists(st.integers(0, NUM_GPUS - 1), min_size=TRACE_LEN,
                                 max_size=TRACE_LEN))
    params = BASE.replace(gpus=stack_profiles(gpus))
    trace = jaxserve.Trace(np.cumsum(gaps), np.array(prompt), np.array(output))
    log = jaxserve.replay(ENV, params, trace, actions=np.array(actions))
    ok = ~log["dropped"]
    eps = 1e-4
    assert np.all(log["start"][ok] >= log["arrival"][ok] - eps)
    assert np.all(log["finish"][ok] >= log["start"][ok] - eps)
    assert np.all(np.isnan(log["start"][~ok]))
    max_batch = np.asarray([g.max_batch for g in gpus])
    for g in range(NUM_GPUS):
        mine = ok & (log["gpu"] == g)
        ids, sizes = np.unique(log["batch"][mine], return_counts=True)
        assert np.all(sizes <= max_batch[g])
        # Batches on one GPU never overlap: sorted by start, each starts after the last ends.
        starts = np.array([log["start"][mine & (log["batch"] == b)][0] for b in ids])
        ends = np.array([log["finish"][mine & (log["batch"] == b)][0] for b in ids])
        order = np.argsort(starts)
        assert np.all(starts[order][1:] >= ends[order][:-1] - eps)
