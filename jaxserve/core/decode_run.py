"""Runs of pure-decode iterations skipped in closed form (`decode_run`).

When every running request decodes, the whole batch fits the token budget and KV blocks, and
the waiting head cannot be admitted, the next iterations' schedules are fixed: only contexts
grow. Their number (up to the next finish, block shortage, admission or horizon) and the
run's end time then follow without iterating, which is what makes long decode phases cheap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core import queues as Q
from jaxserve.core.cpu_numerics import add_time, cdiv, div, mod, rowsum
from jaxserve.core.lanes import batch_max
from jaxserve.core.prefix_cache import RUN_BLOCKS, PrefixTables, run_blocks, run_head_check
from jaxserve.core.replica import ReplicaProfile
from jaxserve.core.replica_state import Replicas, watermark_blocks


# Longest run of decode iterations skipped at one boundary (a binary search of
# log2(RUN_CAP + 1) halvings finds its length); longer runs take several boundaries.
RUN_CAP = 2 ** 14 - 1


def decode_run(rep: Replicas, prof: ReplicaProfile, go: jax.Array, t: jax.Array,
                t_lo: jax.Array, horizon: jax.Array, tables: PrefixTables | None = None):
    """Skips, in closed form, the run of pure-decode iterations whose schedule is fixed.

    At a boundary where every running request decodes (`g >= 1`, `C = L - 1`) and all fit
    the token budget, and the waiting head cannot be admitted, the next iterations schedule
    the same `n` requests one token each until a request completes, KV blocks run short
    (preemption), or the decision horizon comes: nothing frees blocks or budget before a
    completion, the queue's head does not change, and the free blocks only fall, so
    admission keeps failing. Iteration `j` of the run lasts `T_j = A + B j` with
    `A = c0 + beta + (alpha + gamma) n + delta sum L`, `B = delta n`, so `k` of them last
    `dur(k) = k A + B k (k - 1) / 2` (an arithmetic series). The run skipped is the longest
    `k` with: no completion at any of its ends (`k < min(o - g)`), the KV blocks of its
    last iteration within the cache (`sum ceil((C + k) / b) <= M`), its last start before
    and its last end at or before `horizon`. Those iterations hold no first token (every
    request already has one) and no finish, so every per-request time stays exact; the
    boundary after the run is scheduled as usual.

    Returns:
      (replicas advanced by the skipped iterations, the clock pair after them, seconds of
      iteration time skipped per replica (`busy`), and with prefix caching every replica's
      free queue after the run (`free_order`'s pair, valid below the free count; else
      None)).
    """
    run = rep.run
    s_n = run.arrival.shape[-1]
    idx = jnp.arange(s_n, dtype=jnp.int32)[None, :]
    valid = idx < run.count[:, None]
    b = prof.block_size[:, None]
    length = run.prompt + run.gen
    n = run.count
    decoding = valid & (run.gen >= 1) & (run.comp == length - 1)
    pure = go & (n > 0) & (decoding.sum(-1) == n) & (n <= prof.max_tokens)
    comp = jnp.where(valid, run.comp, 0)
    comp_blocks = cdiv(comp, b)
    slack = comp_blocks * b - comp  # free token positions in each slot's last block
    slot_blocks0 = jnp.where(valid, comp_blocks, 0).sum(-1)

    def blocks_after(k):  # extra blocks held after k decode iterations, D(k)
        return jnp.where(valid, cdiv(comp + k[:, None], b), 0).sum(-1) - slot_blocks0

    # The waiting head's admission at this boundary (the first iteration's blocks taken).
    w_valid, win = Q.front(rep.queues, 1)
    rows = jnp.arange(n.shape[0])
    h_len = win.prompt[:, 0].astype(jnp.int32) + rep.q_gen[rows, rep.queues.head]
    k1 = prof.max_tokens - n
    d1 = blocks_after(jnp.ones_like(n))
    if rep.pc is None:
        held0 = slot_blocks0
        free0 = prof.kv_blocks - held0
        cap = free0
        chunk = prof.chunked_prefill
        h_n = jnp.where(chunk, jnp.minimum(h_len, k1), h_len)
        admit = (w_valid[:, 0] & (n < prof.max_seqs) & (k1 > 0) & (chunk | (h_len <= k1))
                 & (free0 - d1 - cdiv(h_n, prof.block_size) >= watermark_blocks(prof)))
    else:
        # Held blocks count once however many requests share them; the run may also not
        # take the head's unreferenced cache hits (`run_head_check`).
        pc = rep.pc
        exists = jnp.arange(pc.ref.shape[-1])[None, :] < prof.kv_blocks[:, None]
        held0 = ((pc.ref > 0) & exists).sum(-1).astype(jnp.int32)
        free0 = prof.kv_blocks - held0
        head = (w_valid[:, 0], h_len, pc.q_node[rows, rep.queues.head],
                pc.q_nshared[rows, rep.queues.head], win.req_id[:, 0])
        admit, guard, queue = jax.vmap(run_head_check, in_axes=(0, 0, None, 0, 0, 0, 0))(
            pc, prof, tables, head, n, k1, free0 - d1)
        cap = jnp.minimum(free0, guard)
    left = jnp.where(valid, run.output - run.gen, jnp.int32(2 ** 30)).min(-1)
    if rep.pc is not None:
        # At most RUN_BLOCKS takes and fills per slot (`run_blocks`): slot i's next ones
        # come at iterations f_i + RUN_BLOCKS b and g_i + RUN_BLOCKS b (f_i, g_i < b).
        first_event = jnp.where(valid, jnp.minimum(slack, b - 1 - mod(comp, b)), b).min(-1)
        left = jnp.minimum(left, first_event + RUN_BLOCKS * prof.block_size + 1)
    k_max = jnp.where(pure & ~admit, jnp.clip(left - 1, 0, RUN_CAP), 0)

    nf = n.astype(jnp.float32)
    # Iteration j is `replica.iteration_time(prof, n, 0, n, sum L + n j)` expanded (n > 0
    # decodes, so beta is on); kept in this float order so the skip's results stay the same.
    a_t = (prof.c0 + prof.beta + (prof.alpha + prof.gamma) * nf
           + prof.delta * jnp.where(valid, length, 0).sum(-1).astype(jnp.float32))
    if prof.moe_tokens > 1:  # static, as in `replica.iteration_time`
        a_t = a_t + prof.moe * jnp.minimum(nf, prof.moe_tokens)
    b_t = prof.delta * nf

    def dur(k):
        kf = k.astype(jnp.float32)
        return kf * a_t + b_t * (kf * (kf - 1.0) * 0.5)

    def time_ok(k):
        return ((t + (t_lo + dur(k)) <= horizon)
                & ((k == 0) | (t + (t_lo + dur(k - 1)) < horizon)))

    def ok(k):
        return (blocks_after(k) <= cap) & time_ok(k)

    def halve(_, lo_hi):  # the largest k in [lo, hi] with ok(k); ok is monotone, ok(0)
        lo, hi = lo_hi
        mid = (lo + hi + 1) // 2
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    def search():
        return jax.lax.fori_loop(0, RUN_CAP.bit_length(), halve,
                                 (jnp.zeros_like(k_max), k_max))[0]

    # The KV bound in closed form. Slot i takes its next block at iteration g_i =
    # ((-C_i) mod b) + 1 (in [1, b]) and every b after, so with k = q b + r (0 <= r < b),
    # D(k) = n q + #{i : g_i <= r}. The largest k with D(k) <= cap is q b + g_(e+1) - 1 for
    # q = cap // n, e = cap - n q < n (g_(e+1) the (e+1)-th smallest g): found by halving
    # r over [0, b) (log2 b trips of a compare-and-count, where a search over k takes 14 of
    # D(k)).
    g = jnp.where(valid, slack + 1, b + 1)
    n_pos = jnp.maximum(n, 1)
    q_kv = jnp.maximum(cap, 0) // n_pos
    e_kv = jnp.maximum(cap, 0) - n_pos * q_kv

    def halve_r(_, lo_hi):  # the largest r in [lo, hi] with #{g_i <= r} <= e
        lo, hi = lo_hi
        mid = (lo + hi + 1) // 2
        good = (g <= mid[:, None]).sum(-1) <= e_kv
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    b_row = prof.block_size
    trips = 32 - jax.lax.clz(batch_max(b_row.max()).astype(jnp.int32) - 1)  # log2 b, up
    r_kv = jax.lax.fori_loop(0, trips, halve_r, (jnp.zeros_like(n), b_row - 1))[0]
    k_kv = jnp.where(cap >= 0, q_kv * b_row + r_kv, 0)

    # Usually the run ends at the horizon: the largest k with dur(k) <= room is the stable
    # root of b k^2 / 2 + (a - b / 2) k = room, checked exactly (time_ok) at its neighbours.
    # Where the neighbours do not bracket it, the binary search above runs instead (for the
    # whole batch: `lanes.batch_max`); both give the largest k with ok(k) (ok is the
    # conjunction of two monotone tests: the smaller of their largest k).
    room = horizon - t - t_lo
    lin = a_t - 0.5 * b_t
    root = 2.0 * room / (lin + jnp.sqrt(lin * lin + 2.0 * b_t * jnp.maximum(room, 0.0)))
    guess = jnp.where(jnp.isfinite(room), jnp.floor(jnp.clip(root, 0.0, float(RUN_CAP))),
                      float(RUN_CAP)).astype(jnp.int32)
    near = [jnp.clip(guess + d, 0, k_max) for d in range(-2, 3)]
    near_ok = [time_ok(c) for c in near]
    k_time = near[0]
    for c, good in zip(near[1:], near_ok[1:]):
        k_time = jnp.where(good, c, k_time)
    settled = (near_ok[0] | (near[0] == 0)) & (~near_ok[-1] | (near[-1] == k_max))
    k = jax.lax.cond(batch_max(~settled.all()), search,
                     lambda: jnp.minimum(k_time, k_kv))
    skip = k > 0
    total = dur(k)
    # KV block-seconds: sum_j T_j H(j), H(j) = sum_i ceil((C_i + j + 1) / b). Request i's
    # blocks start at ceil((C_i + 1) / b) and grow by one at each j >= 1 with
    # (C_i + j) mod b = 0: j = f_i + m b, f_i = (-C_i) mod b or b, m < M_i.
    kf = k.astype(jnp.float32)[:, None]
    bf = b.astype(jnp.float32)
    f = jnp.where(slack == 0, b, slack)
    m_i = jnp.where(valid & (k[:, None] - 1 >= f),
                    div(jnp.maximum(k[:, None] - 1 - f, 0), b) + 1, 0)
    mf, ff = m_i.astype(jnp.float32), f.astype(jnp.float32)
    s1 = mf * ff + bf * mf * (mf - 1.0) * 0.5  # sum of the crossings j
    s2 = (mf * ff * ff + ff * bf * mf * (mf - 1.0)
          + bf * bf * (mf - 1.0) * mf * (2.0 * mf - 1.0) / 6.0)  # sum of j^2
    tail = (a_t[:, None] * (mf * kf - s1)
            + b_t[:, None] * (mf * kf * (kf - 1.0) * 0.5 - (s2 - s1) * 0.5))
    h1 = (held0 + d1).astype(jnp.float32)
    kv_s = h1 * total + rowsum(tail)
    end_hi, end_lo = add_time(t, t_lo, total)
    adv = jnp.where(valid & skip[:, None], k[:, None], 0)
    if rep.pc is not None:
        # A no-op where k = 0 (no select of the pool needed).
        rep = rep.replace(pc=jax.vmap(run_blocks)(rep.pc, queue, comp, valid & skip[:, None],
                                                   run.req_id, k, prof.block_size))
        # The run took the free queue's first D(k) blocks: the rest keep their order, so the
        # scheduler that follows reads the queue shifted instead of ranking it again (only
        # ranks below the free count are read).
        taken = jnp.where(skip, blocks_after(k), 0)
        m_blk = queue[0].shape[-1]
        shift = (jnp.arange(m_blk, dtype=jnp.int32)[None, :] + taken[:, None]) % m_blk
        queue = (jnp.take_along_axis(queue[0], shift, -1), queue[1] - taken[:, None])
    else:
        queue = None
    rep = rep.replace(
        run=run.replace(gen=run.gen + adv, comp=run.comp + adv),
        t_start=jnp.where(skip, t + (t_lo + dur(k - 1)), rep.t_start),
        t_end=jnp.where(skip, end_hi, rep.t_end), t_lo=jnp.where(skip, end_lo, rep.t_lo),
        busy=rep.busy + total, kv_block_s=rep.kv_block_s + jnp.where(skip, kv_s, 0.0),
        kv_peak=jnp.where(skip, jnp.maximum(rep.kv_peak, held0 + blocks_after(k)),
                          rep.kv_peak),
        iterations=rep.iterations + k)
    return rep, jnp.where(skip, end_hi, t), jnp.where(skip, end_lo, t_lo), total, queue
