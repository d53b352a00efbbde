"""No program of ours calls LAPACK, and what replaced those calls computes the same values.

jaxlib 0.10's batched CPU LAPACK kernels (QR, LU, ...) fan their batch out on XLA's intra-op
thread pool and block a pool thread until it is done. When as many run at once as the pool has
threads (2 on a 2-core machine), every thread waits for work queued behind it and the program
hangs with the CPU idle: `scripts/reproduce.py --quick` did, in the vmapped training program
(a native stack showed both pool threads in `lapack_sgeqrf_ffi` -> `ParallelBatchMap` ->
`BlockingCounter::Wait`, from the networks' orthogonal initialisation). So the environments'
reset/step, vmapped over environments, and the networks' initialisation, vmapped over seeds,
must lower without a LAPACK custom call. Checked on the lowered program (no compile, no run),
which is deterministic, unlike waiting for a hang.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.agents import TrainConfig, make_network
from jaxserve.agents.networks import NETWORKS, orthogonal
from jaxserve.core import arrivals as A

ENVS = tuple(jaxserve.registered_envs())


def _lapack_calls(lowered) -> list[str]:
    text = lowered.as_text()
    return sorted({line.strip()[:120] for line in text.splitlines() if "lapack" in line})


def _vmapped_rollout_lowered(env, params, lanes=4, steps=3):
    def rollout(key):
        obs, state = env.reset(key, params)

        def step(state, k):
            k_a, k_s = jax.random.split(k)
            action = env.action_space(params).sample(k_a)
            obs, state, reward, *_ = env.step(k_s, state, action, params)
            return state, reward

        return jax.lax.scan(step, state, jax.random.split(key, steps))[1]

    keys = jax.random.split(jax.random.PRNGKey(0), lanes)
    return jax.jit(jax.vmap(rollout)).lower(keys)


@pytest.mark.parametrize("name", ENVS)
def test_env_programs_call_no_lapack(name):
    env, params = jaxserve.make(name, max_steps_in_episode=3)
    assert _lapack_calls(_vmapped_rollout_lowered(env, params)) == []


def test_mmpp_env_programs_call_no_lapack():
    # The MMPP's stationary law is a linear solve at every reset; with three phases so the
    # solve is not a 2x2 special case.
    proc = A.mmpp([1.0, 4.0, 9.0], [[0.0, 0.5, 0.2], [0.3, 0.0, 0.4], [0.1, 0.6, 0.0]])
    env, params = jaxserve.make("Routing-v0", arrivals=proc, max_steps_in_episode=3)
    assert _lapack_calls(_vmapped_rollout_lowered(env, params)) == []


@pytest.mark.parametrize("network", sorted(NETWORKS))
def test_network_init_vmapped_over_seeds_calls_no_lapack(network):
    env, params = jaxserve.make("Routing-v0")
    set_dims = env.obs_layout if network == "set" else None
    net = make_network(TrainConfig(network=network, set_dims=set_dims), env.num_actions)
    obs = jnp.zeros(env.observation_space(params).shape)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    lowered = jax.jit(jax.vmap(lambda k: net.init(k, obs))).lower(keys)
    assert _lapack_calls(lowered) == []


def test_flax_orthogonal_does_call_lapack():
    # The check above can fail: the initialiser it replaced lowers to a LAPACK QR.
    init = nn.initializers.orthogonal(1.0)
    lowered = jax.jit(jax.vmap(lambda k: init(k, (8, 4)))).lower(
        jax.random.split(jax.random.PRNGKey(0), 2))
    assert any("geqrf" in c or "qr" in c.lower() for c in _lapack_calls(lowered))


@pytest.mark.parametrize("shape", [(64, 64), (7, 64), (64, 7), (64, 1), (1, 64), (3, 5)])
def test_orthogonal_matches_flax_and_is_orthogonal(shape):
    for seed in range(3):
        key = jax.random.PRNGKey(seed)
        ours = np.asarray(orthogonal(1.7)(key, shape), np.float64)
        theirs = np.asarray(nn.initializers.orthogonal(1.7)(key, shape), np.float64)
        # Same Gaussian draw, same unique QR (R's diagonal made positive): equal up to
        # float32 rounding, a few ulps times the matrix size (observed <= 6e-6 at 64x64).
        np.testing.assert_allclose(ours, theirs, atol=5e-5)
        q = ours / 1.7
        gram = q.T @ q if shape[0] >= shape[1] else q @ q.T
        np.testing.assert_allclose(gram, np.eye(min(shape)), atol=1e-5)


def test_orthogonal_rejects_non_matrix_kernels():
    with pytest.raises(ValueError, match="2-D"):
        orthogonal()(jax.random.PRNGKey(0), (3, 3, 3))


def test_solve_small_matches_numpy_and_stationary_law():
    rng = np.random.default_rng(0)
    for k in (1, 2, 3, 4, 6):
        for _ in range(5):
            a = rng.normal(size=(k, k)) + k * np.eye(k)  # well conditioned
            b = rng.normal(size=k)
            got = np.asarray(A.solve_small(jnp.asarray(a, jnp.float32),
                                           jnp.asarray(b, jnp.float32)))
            # float32 elimination on a well-conditioned K <= 6 system: a few ulps of |x|.
            np.testing.assert_allclose(got, np.linalg.solve(a, b), rtol=1e-5, atol=1e-5)
    # A zero leading pivot needs the row swap.
    a = np.array([[0.0, 1.0], [2.0, 3.0]])
    np.testing.assert_allclose(
        np.asarray(A.solve_small(jnp.asarray(a, jnp.float32), jnp.array([1.0, 5.0]))),
        np.linalg.solve(a, [1.0, 5.0]), rtol=1e-6)
    proc = A.mmpp([1.0, 4.0, 9.0], [[0.0, 0.5, 0.2], [0.3, 0.0, 0.4], [0.1, 0.6, 0.0]])
    pi = np.asarray(A.stationary(proc), np.float64)
    q = np.asarray(proc.switch, np.float64) * (1 - np.eye(3))
    gen = q - np.diag(q.sum(1))
    np.testing.assert_allclose(pi @ gen, 0.0, atol=1e-6)
    assert abs(pi.sum() - 1.0) < 1e-6
