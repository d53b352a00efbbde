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
between half and all of it.) Every closed form here is `core.replica.iteration_time` summed over
a run of iterations, expanded by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core import continuous as CB
from jaxserve.core import queues as Q
from jaxserve.core.lanes import batch_max
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



# Widths of the request windows the estimates below read: the smallest running-slot and
# waiting-slot widths holding every request present in the batch (`lanes.batch_max`), so
# their pairwise decode term costs O(present^2) instead of O((max_seqs + queue slots)^2). At
# the registered defaults (64 running slots, 128 waiting) a replica holds ~5-30 running and
# 0-60 waiting requests (more as random routing overloads some), and the full-width term was a
# third of LLMRouting-v0's step (docs/benchmarks.md). Few widths, because each pair is a
# branch compiled into the step.
_RUN_WINDOWS = (16, 32, 64, 128, 256, 512, 1024)
_WAIT_WINDOWS = (8, 32, 64)


def _widths(candidates, full: int) -> list[int]:
    """The candidate widths below `full`, then `full`."""
    return [m for m in candidates if m < full] + [full]


def _windowed(rep: CB.Replicas, fn):
    """`fn(m_r, m_w)` at the smallest windows of running and waiting slots that hold every
    replica's requests, over the whole batch under `vmap` (one conditional: `lanes.batch_max`).
    `fn` must compute the same values at every window holding the requests."""
    run_w = _widths(_RUN_WINDOWS, rep.max_seqs)
    wait_w = _widths(_WAIT_WINDOWS, rep.queues.capacity)
    need_r, need_w = rep.run.count.max(), rep.queues.count.max()
    i_r = batch_max(sum((need_r > m).astype(jnp.int32) for m in run_w[:-1]))
    i_w = batch_max(sum((need_w > m).astype(jnp.int32) for m in wait_w[:-1]))
    branches = [lambda m_r=m_r, m_w=m_w: fn(m_r, m_w) for m_r in run_w for m_w in wait_w]
    return jax.lax.switch(i_r * len(wait_w) + i_w, branches)


def _present(rep: CB.Replicas, prof: ReplicaProfile, m_r: int, m_w: int):
    """Per-request quantities of every request present, `(R, m_r + m_w)` each: the first `m_r`
    running slots in admission order, then the first `m_w` waiting slots front to back (the
    windows must hold every request present). Returns (valid, age (s), output estimate,
    decodes left `k`, prefill tokens left, per-iteration decode cost `c` (s), KV blocks it
    needs at its estimated full length); empty slots hold 0."""
    run, q = rep.run, rep.queues
    col = jax.tree.map(lambda x: x[:, None], prof)
    r_valid = jnp.arange(m_r)[None, :] < run.count[:, None]
    w_valid, win = Q.front(q, m_w)
    cat = lambda a, b: jnp.concatenate([jnp.asarray(a[:, :m_r], jnp.float32),  # noqa: E731
                                        jnp.asarray(b, jnp.float32)], -1)
    valid = jnp.concatenate([r_valid, w_valid], -1)
    prompt = cat(run.prompt, win.prompt)
    est = jnp.maximum(cat(run.estimate, win.estimate), 1.0)
    gen = cat(run.gen, jnp.zeros_like(win.estimate))
    comp = cat(run.comp, jnp.zeros_like(win.estimate))
    age = jnp.where(valid, -cat(run.arrival, win.arrival), 0.0)
    k = jnp.maximum(est - gen, 1.0)
    pre = jnp.maximum(prompt - comp, 0.0)
    c = col.alpha + col.gamma + col.delta * (prompt + gen + k / 2.0)
    blocks = jnp.ceil((prompt + est) / col.block_size.astype(jnp.float32))
    z = lambda x: jnp.where(valid, x, 0.0)  # noqa: E731
    return valid, age, est, z(k), z(pre), z(c), z(blocks)


def _slowdown(prof: ReplicaProfile, n, blocks) -> jax.Array:
    """How many times longer everything takes when a replica cannot run all `n` requests
    (needing `blocks` KV blocks) at once: `max(1, n / max_seqs, blocks / usable blocks)`."""
    room = (prof.kv_blocks - CB.watermark_blocks(prof)).astype(jnp.float32)
    return jnp.maximum(jnp.maximum(1.0, n / prof.max_seqs.astype(jnp.float32)),
                       blocks / jnp.maximum(room, 1.0))


def _prefill_time(prof: ReplicaProfile, tokens) -> jax.Array:
    """Seconds of iteration time `tokens` prefill tokens add (`alpha p + alpha2 p^2`, the
    prefill terms of `replica.iteration_time` for an unchunked prompt)."""
    return prof.alpha * tokens + prof.alpha2 * tokens * tokens


def remaining_times(rep: CB.Replicas, prof: ReplicaProfile):
    """Estimated seconds until each request present finishes, from output estimates.

    The replica is taken to run every request it holds at once (continuous batching), each
    decode iteration lasting `c0 + beta + sum of the active requests' decode costs`
    (`gamma + alpha + delta * length` each, `length` at its estimated midpoint), after every
    pending prefill (`alpha p + alpha2 p^2` each) has stalled it once. So request `j`, with
    `k_j` decodes left, finishes after `(c0 + beta) k_j + sum_l c_l min(k_l, k_j) + prefills`,
    times a slowdown `max(1, n / max_seqs, KV blocks needed / blocks usable)` when the replica
    cannot hold them all. An estimate (no preemption order, no FCFS admission wait).

    Returns:
      (finish, valid, age, estimate), each `(R, max_seqs + slots)`: estimated seconds until
      the request finishes, whether the slot holds a request, seconds since its arrival, its
      output estimate (tokens); the waiting slots hold the queue in order.
    """
    s, w = rep.max_seqs, rep.queues.capacity

    def at(m_r, m_w):
        out = _remaining(rep, prof, m_r, m_w)
        pad = lambda x: jnp.concatenate([  # noqa: E731
            jnp.pad(x[:, :m_r], ((0, 0), (0, s - m_r))),
            jnp.pad(x[:, m_r:], ((0, 0), (0, w - m_w)))], -1)
        return tuple(pad(x) for x in out)

    return _windowed(rep, at)


def _remaining(rep: CB.Replicas, prof: ReplicaProfile, m_r: int, m_w: int):
    """`remaining_times` over windows of `m_r` running and `m_w` waiting slots."""
    valid, age, est, k, pre, c, blocks = _present(rep, prof, m_r, m_w)
    shared = jnp.minimum(k[..., :, None], k[..., None, :])  # (R, N, N): decodes run together
    decode = (prof.c0 + prof.beta)[:, None] * k + (shared * c[..., None, :]).sum(-1)
    stall = _prefill_time(jax.tree.map(lambda x: x[:, None], prof), pre).sum(-1)
    slow = _slowdown(prof, valid.sum(-1), blocks.sum(-1))
    finish = jnp.where(valid, (decode + stall[:, None]) * slow[:, None], 0.0)
    return finish, valid, age, est


def expected_backlog(rep: CB.Replicas, prof: ReplicaProfile) -> jax.Array:
    """Expected remaining time-in-system of every request present, summed (s); a scalar.

    The sum of `remaining_times`: the potential of LLMRouting-v0's reward shaping, the
    continuous-batching counterpart of `envs.routing.expected_backlog`.
    """
    return _windowed(rep, lambda m_r, m_w: _remaining(rep, prof, m_r, m_w)[0].sum()
                     ).astype(jnp.float32)


def marginal_backlog(rep: CB.Replicas, prof: ReplicaProfile, prompt, estimate) -> jax.Array:
    """Increase of each replica's summed `remaining_times` if a new request of `prompt`
    tokens and output estimate `estimate` joined it, `(R,)` float32 (s): its own estimated
    latency there plus the delay it adds to the requests present (a longer decode iteration
    while they share it, its prefill stall, a larger slowdown)."""
    return _windowed(rep, lambda m_r, m_w: _marginal(rep, prof, prompt, estimate, m_r, m_w))


def backlog_and_marginal(rep: CB.Replicas, prof: ReplicaProfile, prompt,
                         estimate) -> tuple[jax.Array, jax.Array]:
    """`(expected_backlog, marginal_backlog)` of one cluster from one window (their pairwise
    term computed once): what LLMRouting-v0's step needs for its shaping potential and its
    observation of the next request."""
    def at(m_r, m_w):
        finish = _remaining(rep, prof, m_r, m_w)[0]
        return (finish.sum().astype(jnp.float32),
                _marginal(rep, prof, prompt, estimate, m_r, m_w))

    return _windowed(rep, at)


def _marginal(rep: CB.Replicas, prof: ReplicaProfile, prompt, estimate, m_r: int,
              m_w: int) -> jax.Array:
    """`marginal_backlog` over windows of `m_r` running and `m_w` waiting slots."""
    valid, _, _, k, pre, c, blocks = _present(rep, prof, m_r, m_w)
    finish, *_ = _remaining(rep, prof, m_r, m_w)
    p = jnp.asarray(prompt, jnp.float32)
    kx = jnp.maximum(jnp.asarray(estimate, jnp.float32), 1.0)
    cx = prof.alpha + prof.gamma + prof.delta * (p + kx / 2.0)
    bx = jnp.ceil((p + kx) / prof.block_size.astype(jnp.float32))
    stall = _prefill_time(jax.tree.map(lambda x: x[:, None], prof), pre).sum(-1)
    stall_x = _prefill_time(prof, p)
    n = valid.sum(-1)
    slow0 = _slowdown(prof, n, blocks.sum(-1))
    slow1 = _slowdown(prof, n + 1, blocks.sum(-1) + bx)
    base = finish.sum(-1) / slow0  # the sum before the slowdown
    others = cx * jnp.minimum(k, kx).sum(-1) + n * stall_x
    own = ((prof.c0 + prof.beta) * kx + (c * jnp.minimum(k, kx)).sum(-1) + cx * kx
           + stall + stall_x)
    return ((base + others + own) * slow1 - base * slow0).astype(jnp.float32)


def expected_slo_misses(rep: CB.Replicas, prof: ReplicaProfile, slo_ttft_s,
                        slo_tpot_s) -> jax.Array:
    """Requests present expected to miss their SLO, a float32 scalar count.

    A request meeting both targets finishes within `slo_ttft_s + slo_tpot_s * (o - 1)` of
    its arrival; one whose age plus `remaining_times` exceeds that deadline (`o` its output
    estimate) is counted. The potential of LLMRouting-v0's shaped SLO reward.
    """
    def at(m_r, m_w):
        finish, valid, age, est = _remaining(rep, prof, m_r, m_w)
        deadline = slo_ttft_s + slo_tpot_s * jnp.maximum(est - 1.0, 0.0)
        return (valid & (age + finish > deadline)).sum().astype(jnp.float32)

    return _windowed(rep, at)
