"""Queueing-theory anchors (MODEL.md): with max_batch 1 a GPU is an M/G/1 queue.

Service times take two values (two request classes of fixed size), so E[S] and E[S^2] are
exact. Each test runs `NUM_ENVS` independent replications under vmap, drops a warm-up, and
compares the grand mean wait with Pollaczek-Khinchine. Tolerance: 4 standard errors of the
mean across the independent replications, plus 3% of W for the bias of the finite warm-up and
of the ratio estimator (sum of latencies / completions). With fixed keys the test is
deterministic; the tolerance says it would pass for ~all keys, not just these.
"""

import jax
import numpy as np
import pytest

import jaxserve
from jaxserve.core import arrivals as A
from jaxserve.reference.sim import mg1_mean_wait

PROFILE = jaxserve.GPUProfile(c0=0.05, alpha=1e-4, beta=0.01, gamma=0.0, delta=0.0,
                              max_batch=1, queue_cap=64, timeout=0.0)
CLASSES = dict(weights=[0.7, 0.3], prompt=[100.0, 1000.0], output=[10.0, 100.0])
NUM_ENVS, NUM_STEPS, WARMUP = 48, 12_000, 3_000


def service_moments():
    s = np.array([PROFILE.c0 + PROFILE.alpha * p + PROFILE.beta * o
                  for p, o in zip(CLASSES["prompt"], CLASSES["output"])])
    w = np.array(CLASSES["weights"])
    return float((w * s).sum()), float((w * s * s).sum())


def mean_wait_by_replication(num_gpus, rate, queue_cap):
    tokens = A.class_mixture(CLASSES["weights"], CLASSES["prompt"], [0.0, 0.0],
                             CLASSES["output"], [0.0, 0.0])
    profile = PROFILE.replace(queue_cap=queue_cap)
    env, params = jaxserve.make("Routing-v0", gpus=[profile] * num_gpus, arrival_rate=rate,
                                tokens=tokens, max_steps_in_episode=NUM_STEPS + 1)

    def run(key):
        _, state = env.reset(key, params)

        def step(state, k):
            k_a, k_s = jax.random.split(k)
            a = jax.random.randint(k_a, (), 0, num_gpus)  # random routing
            _, state, _, _, _, info = env.step(k_s, state, a, params)
            return state, (info["latency_sum"], info["completed"], info["dropped"])

        _, out = jax.lax.scan(step, state, jax.random.split(key, NUM_STEPS))
        return out

    lat, done, dropped = jax.jit(jax.vmap(run))(jax.random.split(jax.random.PRNGKey(0), NUM_ENVS))
    lat, done = np.asarray(lat, np.float64)[:, WARMUP:], np.asarray(done)[:, WARMUP:]
    assert int(np.asarray(dropped).sum()) == 0
    es, _ = service_moments()
    return lat.sum(1) / done.sum(1) - es


# Queue buffers sized so that drops have probability < 1e-5 per request (asserted: none).
@pytest.mark.parametrize("num_gpus, rho, queue_cap", [(1, 0.5, 32), (1, 0.9, 128), (3, 0.7, 64)])
def test_mean_wait_matches_pollaczek_khinchine(num_gpus, rho, queue_cap):
    es, es2 = service_moments()
    rate_per_gpu = rho / es
    want = mg1_mean_wait(rate_per_gpu, es, es2)
    waits = mean_wait_by_replication(num_gpus, rate_per_gpu * num_gpus, queue_cap)
    got = waits.mean()
    se = waits.std(ddof=1) / np.sqrt(len(waits))
    assert abs(got - want) <= 4 * se + 0.03 * want, (got, want, se)
