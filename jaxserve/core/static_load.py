"""The static batcher's load estimates (MODEL.md's engine, `core.cluster`): the expected
remaining time-in-system of the requests a cluster holds, and how much one more request adds.

Read only from what a scheduler knows (prompts, output *estimates*, each running batch's
expected end `est_end`), never true output lengths. Routing-v0's reward-shaping potential and
its greedy router (`least_marginal`) read them through `core.engines.STATIC`; the continuous
engine's counterparts are `core.continuous_load`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core import cluster as C


def expected_backlog(cluster: C.Cluster, gpus) -> jax.Array:
    """Expected remaining time-in-system of every request present, summed (s); a scalar.

    Per GPU, from what the scheduler knows (prompts, output *estimates*, `est_end`): the
    running batch's requests leave at its expected end `R = max(est_end, 0)`. The `n` waiting
    requests follow in `nb = ceil(n / max_batch)` batches that together take
    `T = nb*c0 + alpha*sum p + alpha2*sum p^2 + o_max*(nb*beta + gamma*n + delta*sum p)`
    (`service.batch_service_time` per batch, every batch's longest output taken as `o_max`,
    the largest estimate to have joined the queue since it was last empty), finishing at
    `R + T/nb, R + 2T/nb, ...`, so on average at `R + T * (nb + 1) / (2 nb)`. The potential of
    Routing-v0's reward shaping. A function of the state alone: the sums and `o_max` are the
    per-GPU running totals of `cluster.waiting`, so it reads no queue slot.
    """
    per_gpu = backlog_per_gpu(cluster, gpus)
    # Summed GPU by GPU (a static unroll), not with `.sum()`: under `vmap`, XLA's CPU backend
    # hands a reduction fused with this arithmetic to a YNNPACK kernel that measured ~5x
    # slower than the plain elementwise fusion the unrolled adds give.
    return sum(per_gpu[..., g] for g in range(per_gpu.shape[-1])).astype(jnp.float32)


def marginal_backlog(cluster: C.Cluster, gpus, prompt, estimate) -> jax.Array:
    """Per GPU, how much `expected_backlog` grows (s) if a request of `prompt` tokens and
    output estimate `estimate` joins that GPU's queue, `(num_gpus,)` float32: its own expected
    time-in-system plus the delay it adds to the requests queued there.

    The step-by-step greedy policy of Routing-v0's shaping potential
    (`policies.generic.least_marginal`) takes its argmin.
    """
    before = backlog_per_gpu(cluster, gpus)
    after = backlog_per_gpu(cluster, gpus, (prompt, estimate))
    return (after - before).astype(jnp.float32)


def backlog_per_gpu(cluster: C.Cluster, gpus, joining=None) -> jax.Array:
    """`expected_backlog`'s per-GPU terms `(num_gpus,)` (s); with `joining = (prompt,
    estimate)`, each GPU's term as if that request had joined its queue (alone)."""
    q, s, w = cluster.queues, cluster.servers, cluster.waiting
    run_left = jnp.where(s.run_count > 0, jnp.maximum(s.est_end, 0.0), 0.0)
    # Written in expected_backlog's original order, so the potential's program is unchanged.
    n = q.count.astype(jnp.float32)
    if joining is not None:  # static
        n = n + 1.0
    b = jnp.maximum(gpus.max_batch, 1).astype(jnp.float32)
    nb = jnp.maximum(jnp.ceil(n / b), 1.0)
    # Clipped at 0: the running sums may round a hair below it before the queue empties.
    sum_p, sum_p2 = jnp.maximum(w.prompt_sum, 0.0), jnp.maximum(w.prompt_sq_sum, 0.0)
    o_max = w.estimate_max
    if joining is not None:  # static: the potential itself never takes this branch
        p, est = joining
        sum_p, sum_p2, o_max = sum_p + p, sum_p2 + p * p, jnp.maximum(o_max, est)
    t_all = (nb * gpus.c0 + gpus.alpha * sum_p + gpus.alpha2 * sum_p2
             + o_max * (nb * gpus.beta + gpus.gamma * n + gpus.delta * sum_p))
    return s.run_count * run_left + n * (run_left + t_all * (nb + 1.0) / (2.0 * nb))


def mean_estimate_held(cluster: C.Cluster) -> jax.Array:
    """Per GPU, the mean output *estimate* (tokens) of the requests it holds, waiting and
    running, `(num_gpus,)` float32; 0 for an empty GPU. What a router can know of how long the
    requests already there will run."""
    q, s = cluster.queues, cluster.servers
    held = q.count.astype(jnp.float32) + s.run_count.astype(jnp.float32)
    return (q.estimate_sum + s.run_estimate) / jnp.maximum(held, 1.0)

