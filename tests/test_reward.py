"""The episodic return is the documented affine function of total latency and drops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.core.sources import trace_arrays


# Routing-v0's default reward adds potential-based shaping (discount 0.99); undiscounted
# shaping (1.0) telescopes to phi(drained) - phi(empty) = 0, so both forms below give exactly
# the unshaped episode return.
@pytest.mark.parametrize("name,extra", [("Routing-v0", {"shaping_gamma": None}),
                                        ("Routing-v0", {"shaping_gamma": 1.0}),
                                        ("Batching-v0", {})])
def test_return_of_a_drained_trace_episode_is_minus_total_latency_and_drops(name, extra):
    rng = np.random.default_rng(0)
    n = 60
    trace = jaxserve.Trace(np.cumsum(rng.exponential(0.3, n)), rng.integers(1, 2000, n),
                           rng.integers(1, 300, n))
    small = jaxserve.GPUProfile(c0=0.02, alpha=1e-4, beta=0.02, gamma=1e-3, max_batch=4,
                                queue_cap=3)
    gpus = [small] * (2 if name == "Routing-v0" else 1)
    env, params = jaxserve.make(name, gpus=gpus, latency_scale=7.0, drop_penalty_s=30.0,
                                **extra)
    env = env.replace_static(trace_len=n, log_capacity=n)
    params = params.replace(trace=trace_arrays(trace))
    actions = jnp.asarray(rng.integers(0, env.num_actions, 2 * n), jnp.int32)

    @jax.jit
    def episode(key):
        _, state = env.reset_env(key, params)

        def step(carry, x):
            state, done = carry
            k, a = x
            _, nxt, r, term, info = env.step_env(k, state, a, params)
            # Freeze after termination so later steps add nothing.
            state = jax.tree.map(lambda u, v: jnp.where(done, u, v), state, nxt)
            return (state, done | term), (jnp.where(done, 0.0, r),
                                          jnp.where(done, 0, info["dropped"]))

        (state, done), (rew, dropped) = jax.lax.scan(
            step, (state, jnp.bool_(False)), (jax.random.split(key, 2 * n), actions))
        return state.log, done, rew.sum(), dropped.sum()

    log, done, ret, drops = episode(jax.random.PRNGKey(0))
    assert bool(done)
    wait = np.asarray(log.wait, np.float64)
    served = ~np.isnan(wait)
    latency = (wait + np.asarray(log.service, np.float64))[served]
    assert int(drops) == int((~served).sum()) and int(drops) > 0
    want = -(latency.sum() + 30.0 * int(drops)) / 7.0
    np.testing.assert_allclose(float(ret), want, rtol=1e-4)


def test_routing_shaping_is_potential_based():
    """Default Routing-v0 reward = unshaped reward + 0.99 * phi(s') - phi(s), phi = minus the
    expected backlog over latency_scale; phi is 0 for an empty cluster (reset)."""
    from jaxserve.core.static_load import expected_backlog

    env, params = jaxserve.make("Routing-v0")
    plain = env.replace_static(shaping_gamma=None)
    assert env.shaping_gamma == pytest.approx(0.99)
    _, state = env.reset(jax.random.PRNGKey(0), params)
    assert float(expected_backlog(state.cluster, params.gpus)) == 0.0
    scale = float(params.latency_scale)
    rng = np.random.default_rng(1)
    shaped_step, plain_step = jax.jit(env.step_env), jax.jit(plain.step_env)
    for i in range(60):
        k = jax.random.PRNGKey(i + 1)
        a = jnp.int32(rng.integers(0, env.num_gpus))
        _, nxt, r, _, _ = shaped_step(k, state, a, params)
        _, _, r_plain, _, _ = plain_step(k, state, a, params)
        phi0 = -float(expected_backlog(state.cluster, params.gpus)) / scale
        phi1 = -float(expected_backlog(nxt.cluster, params.gpus)) / scale
        np.testing.assert_allclose(float(r), float(r_plain) + 0.99 * phi1 - phi0,
                                   rtol=1e-4, atol=1e-6)
        state = nxt
    assert phi1 < 0.0  # requests are waiting after 60 arrivals
