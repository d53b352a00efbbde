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


def remaining_times(rep: CB.Replicas, prof: ReplicaProfile):
    """Estimated seconds until each request present finishes, from output estimates.

    Requests are taken per replica in service order (running ones in admission order, then
    the waiting queue front to back). Each has work `w` (`request_work` at its prompt and
    output estimate, running ones scaled by the fraction of their estimated tokens still to
    compute, as in `queued_work`) and a remaining span `s` (`full_batch_time` scaled the
    same way: its own decodes at a full batch's pace). Request `i` is estimated to finish at
    `max(W_i, s_i)`, `W_i` the replica's work up to and including `i`: no sooner than its own
    remaining decodes, nor before the replica has done, at full-batch throughput, everything
    ahead of it and itself. An estimate (no preemption, no chunk interleaving).

    Returns:
      (finish, valid, age, estimate), each `(R, max_seqs + slots)`: estimated seconds until
      the request finishes, whether the slot holds a request, seconds since its arrival, its
      output estimate (tokens); the waiting slots hold the queue in order.
    """
    run, q = rep.run, rep.queues
    col = jax.tree.map(lambda x: x[:, None], prof)
    r_valid = jnp.arange(rep.max_seqs)[None, :] < run.count[:, None]
    r_est = jnp.maximum(run.estimate, 1.0)
    total = run.prompt + r_est
    done = jnp.minimum(run.comp.astype(jnp.float32), run.prompt) + run.gen
    left = jnp.clip(1.0 - done / total, 0.0, 1.0)
    w_valid, win = Q.front(q, q.capacity)
    w_est = jnp.maximum(win.estimate, 1.0)
    prompt = jnp.concatenate([run.prompt.astype(jnp.float32), win.prompt.astype(jnp.float32)],
                             -1)
    est = jnp.concatenate([r_est, w_est], -1)
    frac = jnp.concatenate([left, jnp.ones_like(w_est)], -1)
    valid = jnp.concatenate([r_valid, w_valid], -1)
    b = full_batch(col, prompt, est)
    span = full_batch_time(col, prompt, est)
    work = jnp.where(valid, frac * span / b, 0.0)
    cum = jax.lax.associative_scan(jnp.add, work, axis=work.ndim - 1)
    finish = jnp.where(valid, jnp.maximum(cum, frac * span), 0.0)
    age = jnp.where(valid, -jnp.concatenate([run.arrival, win.arrival], -1), 0.0)
    return finish, valid, age, est


def expected_backlog(rep: CB.Replicas, prof: ReplicaProfile) -> jax.Array:
    """Expected remaining time-in-system of every request present, summed (s); a scalar.

    The sum of `remaining_times`: the potential of LLMRouting-v0's reward shaping, the
    continuous-batching counterpart of `envs.routing.expected_backlog`.
    """
    finish, *_ = remaining_times(rep, prof)
    return finish.sum().astype(jnp.float32)


def expected_slo_misses(rep: CB.Replicas, prof: ReplicaProfile, slo_ttft_s,
                        slo_tpot_s) -> jax.Array:
    """Requests present expected to miss their SLO, a float32 scalar count.

    A request meeting both targets finishes within `slo_ttft_s + slo_tpot_s * (o - 1)` of
    its arrival; one whose age plus `remaining_times` exceeds that deadline (`o` its output
    estimate) is counted. The potential of LLMRouting-v0's shaped SLO reward.
    """
    finish, valid, age, est = remaining_times(rep, prof)
    deadline = slo_ttft_s + slo_tpot_s * jnp.maximum(est - 1.0, 0.0)
    return (valid & (age + finish > deadline)).sum().astype(jnp.float32)


def finish_if_routed(rep: CB.Replicas, prof: ReplicaProfile, prompt, estimate) -> jax.Array:
    """Estimated seconds until a request of `prompt` tokens and output estimate `estimate`
    would finish at each replica, `(R,)` float32: `max(queued_work + w, s)` with `w` its
    `request_work` and `s` its `full_batch_time` there, `remaining_times`' estimate for a
    request joining the back of the queue (so also the increase of `expected_backlog` that
    routing it there causes in that model)."""
    est = jnp.maximum(jnp.asarray(estimate, jnp.float32), 1.0)
    own = request_work(prof, prompt, est)
    return jnp.maximum(queued_work(rep, prof) + own, full_batch_time(prof, prompt, est))
