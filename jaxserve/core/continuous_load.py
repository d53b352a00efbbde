"""Load and work estimates for continuous-batching replicas (`core.continuous`).

What a router, an autoscaler or a load calibration can compute from a `ReplicaProfile` and
output *estimates*, without simulating: the throughput of a replica running full batches, the
seconds of replica time one request takes at that throughput, and the seconds of work a
replica still holds. These are estimates (the engine is the truth); they ignore queueing,
preemption and the interleaving of prefill chunks with decodes.

Full-batch model for requests of `p` prompt and `o` output tokens on one replica:

    B       = min(max_seqs, (kv_blocks - watermark blocks) // ceil((p + o) / block_size)), >= 1
    prefill = ceil(B p / max_tokens) c0 + alpha B p + alpha2 B p^2
    decode  = (o - 1) (c0 + beta + B (alpha + gamma) + delta B (p + o / 2))
    T       = prefill + decode                       (s, the batch's span)
    capacity = B / T  (req/s),   work per request = T / B  (s)

(`alpha2 B p^2` is the attention cost of unchunked prompts; with chunking the true cost is
between half and all of it.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core import continuous as CB
from jaxserve.core import queues as Q
from jaxserve.core.replica import ReplicaProfile


def full_batch(prof: ReplicaProfile, prompt, output) -> jax.Array:
    """Requests of `prompt + output` tokens a replica runs at once: `max_seqs`, or fewer when
    the KV cache (less the watermark) binds; at least 1. float32, broadcast over replicas."""
    prof = jax.tree.map(jnp.asarray, prof)  # python scalars (an unstacked profile) too
    p = jnp.asarray(prompt, jnp.float32)
    o = jnp.asarray(output, jnp.float32)
    blocks = jnp.ceil((p + o) / prof.block_size.astype(jnp.float32))
    room = (prof.kv_blocks - CB.watermark_blocks(prof)).astype(jnp.float32)
    return jnp.clip(jnp.floor(room / jnp.maximum(blocks, 1.0)), 1.0,
                    prof.max_seqs.astype(jnp.float32))


def full_batch_time(prof: ReplicaProfile, prompt, output) -> jax.Array:
    """Seconds one full batch (`full_batch`) of `(prompt, output)`-token requests takes."""
    prof = jax.tree.map(jnp.asarray, prof)
    p = jnp.asarray(prompt, jnp.float32)
    o = jnp.maximum(jnp.asarray(output, jnp.float32), 1.0)
    b = full_batch(prof, p, o)
    prefill = (jnp.ceil(b * p / prof.max_tokens.astype(jnp.float32)) * prof.c0
               + prof.alpha * b * p + prof.alpha2 * b * p * p)
    decode = (o - 1.0) * (prof.c0 + prof.beta + b * (prof.alpha + prof.gamma)
                          + prof.delta * b * (p + o / 2.0))
    return prefill + decode


def capacity(prof: ReplicaProfile, prompt, output) -> jax.Array:
    """Requests per second a replica serves running full batches (module docstring)."""
    return full_batch(prof, prompt, output) / full_batch_time(prof, prompt, output)


def request_work(prof: ReplicaProfile, prompt, output) -> jax.Array:
    """Replica-seconds one request takes at full-batch throughput (`1 / capacity`)."""
    return full_batch_time(prof, prompt, output) / full_batch(prof, prompt, output)


def queued_work(rep: CB.Replicas, prof: ReplicaProfile) -> jax.Array:
    """Estimated seconds each replica needs to finish what it holds, `(R,)` float32.

    Waiting requests count `request_work` at their prompt and output estimate; running ones
    the same scaled by the fraction of their estimated tokens still to compute (generated
    tokens and cached prompt tokens done). Output estimates only, never true lengths.
    """
    run = rep.run
    valid = jnp.arange(rep.max_seqs)[None, :] < run.count[:, None]
    col = jax.tree.map(lambda x: x[:, None], prof)
    est = jnp.maximum(run.estimate, 1.0)
    total = run.prompt + est
    done = jnp.minimum(run.comp.astype(jnp.float32), run.prompt) + run.gen
    left = jnp.clip(1.0 - done / total, 0.0, 1.0)
    running = jnp.where(valid, left * request_work(col, run.prompt, est), 0.0).sum(-1)
    q = rep.queues
    wait = jnp.where(Q.waiting_mask(q),
                     request_work(col, q.prompt, jnp.maximum(q.estimate, 1.0)), 0.0).sum(-1)
    return (running + wait).astype(jnp.float32)
