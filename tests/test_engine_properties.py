"""Property tests (hypothesis) of the engine's invariants over random parameters and actions.

Shapes are fixed (3 GPUs, queue buffer 8, max batch 8) so every example reuses one compiled
program; parameters and actions vary as traced values.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxserve
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


@jax.jit
def accounting(params, key):
    """Per step: cumulative arrived, completed, dropped and the requests held in the system."""
    _, state = ENV.reset_env(key, params)

    def step(carry, k):
        state, tot = carry
        k_a, k_s = jax.random.split(k)
        a = jax.random.randint(k_a, (), -1, NUM_GPUS + 1)  # includes invalid actions
        _, state, r, _, info = ENV.step_env(k_s, state, a, params)
        tot = tot + jnp.stack([info["arrived"], info["completed"], info["dropped"]])
        held = (state.cluster.queues.count + state.cluster.servers.run_count).sum()
        finite = jnp.isfinite(r) & jnp.all(jnp.isfinite(ENV.get_obs(state, params)))
        return (state, tot), (tot, held, finite)

    _, out = jax.lax.scan(step, (state, jnp.zeros(3, jnp.int32)), jax.random.split(key, STEPS))
    return out


@SETTINGS
@given(gpus=st.lists(profile, min_size=NUM_GPUS, max_size=NUM_GPUS),
       rate=st.floats(0.05, 200.0), seed=st.integers(0, 2 ** 31 - 1))
def test_every_request_is_accounted_for_at_every_step(gpus, rate, seed):
    params = BASE.replace(gpus=stack_profiles(gpus),
                          arrivals=BASE.arrivals.replace(rates=jnp.asarray([rate], jnp.float32)))
    tot, held, finite = accounting(params, jax.random.PRNGKey(seed))
    tot, held = np.asarray(tot), np.asarray(held)
    # arrived = completed + waiting + running + dropped
    np.testing.assert_array_equal(tot[:, 0], tot[:, 1] + held + tot[:, 2])
    assert np.all(np.asarray(finite))


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
