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
a run of iterations, expanded by hand, without its mixture-of-experts term (`moe`): these are
estimates, and the registered environments' replicas are dense.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core import continuous as CB
from jaxserve.core import queues as Q
from jaxserve.core.lanes import batch_max, map_rows
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
    running = CB.rowsum(jnp.where(valid, left * request_work(col, run.prompt, est), 0.0))
    q = rep.queues
    wait = CB.rowsum(jnp.where(Q.waiting_mask(q),
                               request_work(col, q.prompt, jnp.maximum(q.estimate, 1.0)), 0.0))
    return (running + wait).astype(jnp.float32)



# Widths of the request window the estimates below read: every replica's requests packed
# (running ones, then waiting ones), in the smallest width holding the batch's largest replica
# (`lanes.batch_max`), so their pairwise decode term costs O(width^2) instead of
# O((max_seqs + queue slots)^2). At the registered defaults (64 running slots, 128 waiting) a
# replica holds ~5-40 running and 0-70 waiting requests under random routing (more as it
# overloads some). Packing both into one window sizes it by the largest replica's total, not
# the sum of the largest running set and the longest queue (often on different replicas):
# at steady state under random routing separate running/waiting windows were 64 + 128 wide
# and their pairwise term half of LLMRouting-v0's step (docs/benchmarks.md). Few widths,
# because each is a branch compiled into the step.
_WIDTHS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
# Above this width the pairwise term runs in blocks of replicas (`lanes.map_rows`, CPU):
# measured on 1,024 replicas, its `(rows, width, width)` intermediate left the caches from a
# width of 192 (a full sum ran ~70 ms there against ~1.3-2 ms at 128 and ~5.5 ms in blocks of 64).
_BLOCK_WIDTH = 128
_BLOCK_ELEMENTS = 2 ** 22  # a block's `rows x width x width` intermediate, at most (16 MiB)
# Above this width (a window of more than 2,048 requests: queue and running slots together,
# up to `types.MAX_SLOTS` each) even a block of 8 replicas' `(rows, width, width)` term would
# pass 2^25 elements (and its cost grows as width^2), so the pairwise term is computed from the
# requests sorted by decodes left instead (`_pairwise_sorted`, O(width log width)): the same
# sums, in another order (float32 rounding only).
_SORT_WIDTH = 2048


def _widths(full: int) -> list[int]:
    """The candidate widths below `full`, then `full`."""
    return [m for m in _WIDTHS if m < full] + [full]


def _windowed(rep: CB.Replicas, fn):
    """`fn(m)` at the smallest window of `m` packed requests that holds every replica's
    requests, over the whole batch under `vmap` (one conditional: `lanes.batch_max`).
    `fn` must compute the same values at every window holding the requests."""
    widths = _widths(rep.max_seqs + rep.queues.capacity)
    need = (rep.run.count + rep.queues.count).max()
    i = batch_max(sum((need > m).astype(jnp.int32) for m in widths[:-1]))
    return jax.lax.switch(i, [lambda m=m: fn(m) for m in widths])


def _packed_slots(rep: CB.Replicas, m: int):
    """Where each of `m` packed positions reads from, `(R, m)` each: (valid, is running,
    running slot, waiting slot). Position `j` holds running slot `j` for `j < count`, then the
    waiting queue front to back; positions past the replica's requests are not valid."""
    run, q = rep.run, rep.queues
    pos = jnp.arange(m, dtype=jnp.int32)[None, :]
    n_run = run.count[:, None]
    is_run = pos < n_run
    valid = pos < n_run + q.count[:, None]
    r_slot = jnp.minimum(pos, rep.max_seqs - 1)
    w_slot = (q.head[:, None] + jnp.clip(pos - n_run, 0, q.capacity - 1)) % q.capacity
    return valid, is_run, r_slot, w_slot


def _present(rep: CB.Replicas, prof: ReplicaProfile, m: int):
    """Per-request quantities of every request present, packed into `(R, m)` each: the
    running requests in admission order, then the waiting ones front to back (`m` must hold
    every replica's requests). Returns (valid, age (s), output estimate, decodes left `k`,
    prefill tokens left, per-iteration decode cost `c` (s), KV blocks it needs at its
    estimated full length); positions past a replica's requests hold 0."""
    run, q = rep.run, rep.queues
    col = jax.tree.map(lambda x: x[:, None], prof)
    valid, is_run, r_slot, w_slot = _packed_slots(rep, m)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    # One gather of every field: running slots then waiting slots side by side, each a
    # vector (prompt, estimate, generated, computed, -arrival); waiting requests start over.
    zq = jnp.zeros(q.prompt.shape, jnp.float32)
    fields = jnp.concatenate([
        jnp.stack([f32(run.prompt), f32(run.estimate), f32(run.gen), f32(run.comp),
                   -f32(run.arrival)], -1),
        jnp.stack([f32(q.prompt), f32(q.estimate), zq, zq,
                   -(f32(q.arrival) + q.offset[:, None])], -1)], 1)
    slot = jnp.where(is_run, r_slot, rep.max_seqs + w_slot)
    got = jnp.take_along_axis(fields, slot[..., None], axis=1)
    z = lambda x: jnp.where(valid, x, 0.0)  # noqa: E731
    prompt = z(got[..., 0])
    est = jnp.maximum(got[..., 1], 1.0)
    gen, comp = got[..., 2], got[..., 3]
    age = z(got[..., 4])
    k = jnp.maximum(est - gen, 1.0)
    pre = jnp.maximum(prompt - comp, 0.0)
    c = col.alpha + col.gamma + col.delta * (prompt + gen + k / 2.0)
    blocks = jnp.ceil((prompt + est) / col.block_size.astype(jnp.float32))
    return valid, age, z(est), z(k), z(pre), z(c), z(blocks)


def _block_rows(m: int) -> int:
    """Replicas per block of the pairwise term at width `m` (a power of two, 8-256; 8 at any
    width whose 8 rows pass `_BLOCK_ELEMENTS`)."""
    return max(8, min(256, 1 << max(1, _BLOCK_ELEMENTS // (m * m)).bit_length() - 1))


def _pairwise_sorted(k, c, per_request: bool):
    """`_pairwise`'s sums from the requests sorted by `k`, without the `(m, m)` term.

    With the requests in ascending order of `k` (ties in any order), position `i` shares
    `k_l` decodes with every `l` at or before it and `k_i` with every `l` after it:
    `sum_l c_l min(k_l, k_i) = prefix sum of c k through i + k_i * suffix sum of c after i`
    (a tie's `k_l = k_i`, so which side it falls on does not matter). Empty positions have
    `k = c = 0` and add nothing."""
    axis = k.ndim - 1
    idx = jax.lax.broadcasted_iota(jnp.int32, k.shape, axis)
    ks, cs, order = jax.lax.sort((k, c, idx), dimension=axis, num_keys=1, is_stable=False)
    through = jnp.cumsum(cs * ks, axis=axis)
    rest = jnp.flip(jnp.cumsum(jnp.flip(cs, axis), axis=axis), axis)  # c summed from i on
    after = jnp.concatenate([rest[..., 1:], jnp.zeros_like(rest[..., :1])], axis)
    vals = through + ks * after
    if not per_request:
        return vals.sum(-1)
    # Back to slot order (the indices are distinct: stability does not matter).
    return jax.lax.sort((order, vals), dimension=axis, num_keys=1, is_stable=False)[1]


def _pairwise(per_request: bool):
    """`(k, c) -> sum_l c_l min(k_l, k_j)` for every `j`, `(R, m)` (the decode iterations
    request `j` shares with each request `l`, times their cost), or its sum over `j`, `(R,)`
    (`per_request=False`: all a backlog needs; a full reduction vectorises better)."""
    def fn(k, c):
        shared = jnp.minimum(k[..., :, None], k[..., None, :]) * c[..., None, :]
        return shared.sum(-1) if per_request else shared.sum((-1, -2))

    def run(k, c):
        m = k.shape[-1]
        if m <= _BLOCK_WIDTH:
            return fn(k, c)
        if m > _SORT_WIDTH:
            return _pairwise_sorted(k, c, per_request)
        return map_rows(fn, _block_rows(m))(k, c)

    return run


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
    s = rep.max_seqs

    def at(m):
        present, finish = _remaining(rep, prof, m)
        valid, age, est = present[:3]
        # Back to the slot layout: running slot j is packed position j, waiting slot j (in
        # queue order) position count + j.
        n_run = rep.run.count[:, None]
        pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(s), n_run.shape[:1] + (s,)),
                               n_run + jnp.arange(rep.queues.capacity)], -1)
        here = jnp.concatenate([jnp.arange(s)[None, :] < n_run, jnp.arange(
            rep.queues.capacity)[None, :] < rep.queues.count[:, None]], -1)
        unpack = lambda x: jnp.where(  # noqa: E731
            here, jnp.take_along_axis(x, jnp.minimum(pos, m - 1), axis=1), 0)
        return unpack(finish), unpack(valid), unpack(age), unpack(est)

    return _windowed(rep, at)


def _remaining(rep: CB.Replicas, prof: ReplicaProfile, m: int):
    """`_present` over a window of `m` packed requests and their `remaining_times`:
    `(present, finish)`, `finish` `(R, m)` (s)."""
    present = _present(rep, prof, m)
    valid, _, _, k, pre, c, blocks = present
    decode = (prof.c0 + prof.beta)[:, None] * k + _pairwise(True)(k, c)
    stall = CB.rowsum(_prefill_time(jax.tree.map(lambda x: x[:, None], prof), pre))
    slow = _slowdown(prof, valid.sum(-1), CB.rowsum(blocks))
    return present, jnp.where(valid, (decode + stall[:, None]) * slow[:, None], 0.0)


def _remaining_sum(rep: CB.Replicas, prof: ReplicaProfile, m: int):
    """`_present` over a window of `m` packed requests and each replica's summed
    `remaining_times`, `(present, total)`, `total` `(R,)` (s). (Empty positions have `k = 0`
    and `c = 0`, so they add nothing to the pairwise sum.)"""
    present = _present(rep, prof, m)
    valid, _, _, k, pre, c, blocks = present
    n = valid.sum(-1)
    decode = (prof.c0 + prof.beta) * CB.rowsum(k) + _pairwise(False)(k, c)
    stall = CB.rowsum(_prefill_time(jax.tree.map(lambda x: x[:, None], prof), pre))
    return present, (decode + n * stall) * _slowdown(prof, n, CB.rowsum(blocks))


def expected_backlog(rep: CB.Replicas, prof: ReplicaProfile) -> jax.Array:
    """Expected remaining time-in-system of every request present, summed (s); a scalar.

    The sum of `remaining_times`: the potential of LLMRouting-v0's reward shaping, the
    continuous-batching counterpart of `core.static_load.expected_backlog`.
    """
    return _windowed(rep, lambda m: _remaining_sum(rep, prof, m)[1].sum()).astype(
        jnp.float32)


def marginal_backlog(rep: CB.Replicas, prof: ReplicaProfile, prompt, estimate) -> jax.Array:
    """Increase of each replica's summed `remaining_times` if a new request of `prompt`
    tokens and output estimate `estimate` joined it, `(R,)` float32 (s): its own estimated
    latency there plus the delay it adds to the requests present (a longer decode iteration
    while they share it, its prefill stall, a larger slowdown)."""
    return _windowed(rep, lambda m: _marginal(prof, *_remaining_sum(rep, prof, m), prompt,
                                              estimate))


def backlog_and_marginal(rep: CB.Replicas, prof: ReplicaProfile, prompt,
                         estimate) -> tuple[jax.Array, jax.Array]:
    """`(expected_backlog, marginal_backlog)` of one cluster from one window (their pairwise
    term computed once): what LLMRouting-v0's step needs for its shaping potential and its
    observation of the next request."""
    def at(m):
        present, total = _remaining_sum(rep, prof, m)
        return total.sum().astype(jnp.float32), _marginal(prof, present, total, prompt,
                                                          estimate)

    return _windowed(rep, at)


def _marginal(prof: ReplicaProfile, present, total, prompt, estimate) -> jax.Array:
    """`marginal_backlog` from `_remaining_sum`'s `(present, total)` of one window."""
    valid, _, _, k, pre, c, blocks = present
    p = jnp.asarray(prompt, jnp.float32)
    kx = jnp.maximum(jnp.asarray(estimate, jnp.float32), 1.0)
    cx = prof.alpha + prof.gamma + prof.delta * (p + kx / 2.0)
    bx = jnp.ceil((p + kx) / prof.block_size.astype(jnp.float32))
    stall = CB.rowsum(_prefill_time(jax.tree.map(lambda x: x[:, None], prof), pre))
    stall_x = _prefill_time(prof, p)
    n = valid.sum(-1)
    blocks_sum = CB.rowsum(blocks)
    slow0 = _slowdown(prof, n, blocks_sum)
    slow1 = _slowdown(prof, n + 1, blocks_sum + bx)
    base = total / slow0  # the sum before the slowdown
    others = cx * CB.rowsum(jnp.minimum(k, kx)) + n * stall_x
    own = ((prof.c0 + prof.beta) * kx + CB.rowsum(c * jnp.minimum(k, kx)) + cx * kx
           + stall + stall_x)
    return ((base + others + own) * slow1 - base * slow0).astype(jnp.float32)


def expected_slo_misses(rep: CB.Replicas, prof: ReplicaProfile, slo_ttft_s,
                        slo_tpot_s) -> jax.Array:
    """Requests present expected to miss their SLO, a float32 scalar count.

    A request meeting both targets finishes within `slo_ttft_s + slo_tpot_s * (o - 1)` of
    its arrival; one whose age plus `remaining_times` exceeds that deadline (`o` its output
    estimate) is counted. The potential of LLMRouting-v0's shaped SLO reward.
    """
    def at(m):
        (valid, age, est, *_), finish = _remaining(rep, prof, m)
        deadline = slo_ttft_s + slo_tpot_s * jnp.maximum(est - 1.0, 0.0)
        return (valid & (age + finish > deadline)).sum().astype(jnp.float32)

    return _windowed(rep, at)
