"""Prefill/decode disaggregation: the JAX engine of `docs/disaggregation.md`.

A pool of P (prefill) and a pool of D (decode) continuous-batching replicas and one
KV-transfer link. Both pools are rows of one `Replicas` (P rows first) with one stacked
`ReplicaProfile` (`pool_profile`), so one call of the colocated engine's boundary serves every
replica: `scheduler.schedule_remote` (the colocated `running_pass` and `apply_schedule`, with
the page's remote list and pending requests, which P rows never have, so a P row's boundary
is the colocated one) and the colocated `_end_iteration`. This module adds what crosses
replicas:

* the P -> D handover: a P request of `(p, 1)` finishing appends its D request of `(p, o)`,
  *pending*, to the end of its D replica's waiting queue; P keeps `ceil(p / b_P)` blocks
  (`PDCluster.sending`) until the transfer ends;
* the transfers: started by D's admission (`schedule_remote` allocates a pending request's
  blocks), each lasting `base_latency + bytes / (bandwidth / n)` (`n` transfers in flight
  counting this one, when the link is shared; fixed at its start), `bytes = ceil(p / b_P) *
  b_P * kv_bytes_per_token`; at its end P frees the blocks and the D request becomes
  *ready* (it is then admitted for one token with `C = p - 1`);
* the event order at one instant (page section 9): iteration ends (handovers in P index,
  then slot order), transfer ends, then (between `advance` calls) arrivals, then scheduling
  (transfers start in D index order, then allocation order; P replicas do not depend on
  D's scheduling at one instant, nor D replicas on one another's, so all are scheduled at
  once).

Event-driven and exact: `advance` jumps from event to event of the whole cluster (the
earliest iteration end, transfer end, or the current instant when a replica can schedule);
replicas are not independent between arrivals (a P finish feeds a D queue, a transfer start
depends on the link's other transfers), so one trip of its loop handles one instant of the
cluster. The closed-form skip of decode runs (`decode_run`) is not used: a run on a D
replica may be cut by a handover or a transfer end at another replica's instant, so every
iteration has its boundary (exact; slower on long decodes).

Clock: as `continuous`: stored times are relative to the current decision instant; `rebase`
moves the origin; replica clocks and transfer ends are compensated float32 pairs
(`cpu_numerics.add_time`). Events at one instant are those with equal high parts.

Static shapes (`empty_pd`): running slots and waiting buffers per replica, the remote list
(`X` entries per replica), the transfer table (`T` entries), the admission window over the
waiting queue (`advance`'s `width`) and the per-request tables and log (`N` requests). A
handover, remote entry or transfer that does not fit is counted in `PDCluster.overflow`
(results are then not the contract's; `disagg_replay.simulate_disagg` sizes everything so
that it cannot happen and checks it). The state's types and constructors are in
`disagg_state`, re-exported here.

Per-request tables: the P -> D handover reads the request's D replica, P replica and output
tokens from `PDTables` (indexed by request id), written by `route`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core import queues as Q
from jaxserve.core.continuous import _end_iteration, rebase as rebase_replicas, zero_extras
from jaxserve.core.cpu_numerics import add_time, cdiv, cumsum
from jaxserve.core.disagg_state import (LINK_DEFAULTS, Link, PDCluster, PDLog, PDTables,
                                        RemoteList, Transfers, empty_pd, empty_pd_log,
                                        make_link, pool_profile)
from jaxserve.core.lanes import compacted_while
from jaxserve.core.metrics import StepMetrics
from jaxserve.core.replica import ReplicaProfile
from jaxserve.core.replica_state import Replicas, never_fits
from jaxserve.core.scheduler import route as route_replica
from jaxserve.core.scheduler import schedule_remote

__all__ = ["Link", "make_link", "RemoteList", "Transfers", "PDTables", "PDLog", "PDCluster",
           "empty_pd", "empty_pd_log", "pool_profile", "route", "advance", "rebase",
           "replica_views", "LINK_DEFAULTS"]


def route(st: PDCluster, prof: ReplicaProfile, req: Q.Request, p_idx: jax.Array,
          d_idx: jax.Array, enabled: jax.Array | bool = True):
    """Routes an arriving request (at the current instant): to P replica `p_idx` as a P
    request of `(p, 1)`, its D request later to D replica `d_idx`; or, with `p_idx < 0`,
    entirely to D replica `d_idx` as a colocated request (page sections 3-5). Indices are
    within each pool.

    Drops (page section 5): disaggregated, when it could never fit P as `(p, 1)` or D as
    `(p, o)`, or P's waiting queue holds `queue_cap` requests never preempted; not
    disaggregated, as the colocated engine on D, counting toward `queue_cap` every request D
    holds that has not started running (waiting ones never preempted, pending included, and
    the remote list's).
    `req.req_id` (in `[0, N)`) indexes the per-request tables and the log (the P request
    is logged as `N + req_id`); `req.output` is `o`. Where `enabled` is False nothing
    changes.

    Returns:
      (cluster, dropped, never_fit): bool scalars.
    """
    n = st.tables.src.shape[0]
    num_p = st.is_prefill.sum().astype(jnp.int32)
    p_idx = jnp.asarray(p_idx, jnp.int32)
    dis = p_idx >= 0
    d_row = num_p + jnp.asarray(d_idx, jnp.int32)
    p_row = jnp.maximum(p_idx, 0)
    rid = jnp.where(enabled, req.req_id, n)  # out of range: dropped
    tables = st.tables.replace(
        src=st.tables.src.at[rid].set(jnp.where(dis, p_idx, -1), mode="drop"),
        dest=st.tables.dest.at[rid].set(d_row, mode="drop"),
        output=st.tables.output.at[rid].set(req.output.astype(jnp.int32), mode="drop"))
    d_never = never_fits(jax.tree.map(lambda x: x[d_row], prof), req.prompt, req.output)
    # One queueing, at P (the P request `(p, 1)`, logged as `N + id`) or at D.
    one = req.replace(output=jnp.where(dis, 1.0, req.output),
                      req_id=jnp.where(dis, req.req_id + n, req.req_id))
    # D's queue cap counts its remote entries too (requests held, not started; a P row has
    # none): the colocated cap test (`count < queue_cap + preempted in queue`) with the cap
    # lowered by them.
    cap = prof.replace(queue_cap=prof.queue_cap - st.remote.count)
    pool, dropped, never = route_replica(st.pool, cap, one, jnp.where(dis, p_row, d_row),
                                         enabled & ~(dis & d_never))
    return st.replace(pool=pool, tables=tables), dropped, never | (dis & d_never)


def _schedulable(st: PDCluster) -> jax.Array:
    """`(R,)` replicas that would schedule at the current instant: idle, not stalled, with
    work (a D replica's ready remote requests are work). A replica whose boundary preempted
    and scheduled nothing is left so (`schedule_remote`): the next trip is at the same
    instant (page section 8, step 3)."""
    p = st.pool
    ready = (st.remote.valid & st.remote.ready).any(-1)
    return ~p.in_iter & ~p.stalled & (((p.queues.count + p.run.count) > 0) | ready)


def _due(st: PDCluster, horizon) -> jax.Array:
    """Whether an event is due by `horizon`: an iteration or transfer ending at or before it,
    or a replica able to schedule before it."""
    x = st.transfers
    return ((st.pool.in_iter & (st.pool.t_end <= horizon)).any()
            | (x.active & (x.end <= horizon)).any()
            | (_schedulable(st).any() & (st.now < horizon)))


def _handover(st: PDCluster, pool: Replicas, run, done: jax.Array
              ) -> tuple[PDCluster, Replicas]:
    """Appends the D request of every finished P request (`done` `(R, S)` over the running
    slots `run`, before compaction) to its D replica's waiting queue, pending, in P index
    then slot order (page section 9); wakes those D replicas."""
    n = st.tables.src.shape[0]
    q = pool.queues
    r_n, cap = q.arrival.shape
    # In P row then slot order, each finished P request's D row and its rank among the
    # handovers to that row: its queue position is the row's count plus that rank.
    flat = done.ravel()
    rid = jnp.where(flat, run.req_id.ravel() - n, 0)  # the P request is logged as N + id
    d = jnp.where(flat, st.tables.dest[rid], r_n)
    onehot = (d[:, None] == jnp.arange(r_n)[None, :]).astype(jnp.int32)  # (R S, R)
    rank = ((cumsum(onehot.T) - onehot.T) * onehot.T).sum(0)
    pushed = onehot.sum(0)
    d_c = jnp.minimum(d, r_n - 1)
    fits = flat & (q.count[d_c] + rank < cap)
    slot = jnp.where(fits, (q.head[d_c] + q.count[d_c] + rank) % cap, cap)
    row = jnp.where(fits, d_c, r_n)
    # Rows written to are re-anchored to offset 0 first, as `queues.push` does.
    hit = pushed > 0
    arrival = jnp.where(hit[:, None], q.arrival + q.offset[:, None], q.arrival)
    fl = jnp.stack([arrival, q.prompt, q.output, q.estimate], -1).at[row, slot].set(
        jnp.stack([run.arrival.ravel(), run.prompt.ravel().astype(jnp.float32),
                   st.tables.output[rid].astype(jnp.float32), jnp.zeros_like(rid, jnp.float32)],
                  -1), mode="drop")
    zeros = jnp.zeros_like(rid)
    it = jnp.stack([q.req_id, pool.q_gen, pool.q_pre, st.q_pending.astype(jnp.int32)], -1).at[
        row, slot].set(jnp.stack([rid, zeros, zeros, jnp.ones_like(rid)], -1), mode="drop")
    added = jnp.zeros((r_n,), jnp.int32).at[row].add(1, mode="drop")
    q = q.replace(arrival=fl[..., 0], prompt=fl[..., 1], output=fl[..., 2], estimate=fl[..., 3],
                  req_id=it[..., 0], count=q.count + added,
                  offset=jnp.where(hit, 0.0, q.offset))
    pool = pool.replace(queues=q, q_gen=it[..., 1], q_pre=it[..., 2],
                        stalled=pool.stalled & ~hit)
    over = (flat & ~fits).sum().astype(jnp.int32)
    return st.replace(q_pending=it[..., 3] > 0, overflow=st.overflow + over), pool


def _end_transfers(st: PDCluster, pool: Replicas, t, log: PDLog):
    """Ends every transfer due at `t`: P frees its blocks, the D request becomes ready; both
    replicas wake (page section 3, step 7)."""
    x = st.transfers
    end = x.active & (x.end <= t)
    r_n = pool.num_replicas
    freed = jnp.zeros((r_n,), jnp.int32).at[x.p].add(jnp.where(end, x.blocks, 0))
    wake = (jnp.zeros((r_n,), jnp.bool_).at[jnp.where(end, x.p, r_n)].set(True, mode="drop")
            .at[jnp.where(end, x.d, r_n)].set(True, mode="drop"))
    rm = st.remote
    rows = jnp.arange(r_n, dtype=jnp.int32)[:, None, None]
    hit = (end[None, None, :] & (x.d[None, None, :] == rows)
           & (x.req_id[None, None, :] == rm.req_id[:, :, None])).any(-1)
    size = log.transfer_end.shape[0]
    ids = jnp.where(end, x.req_id, size)
    log = log.replace(transfer_end=log.transfer_end.at[ids].set((x.end - x.arrival) + x.end_lo,
                                                                mode="drop"))
    st = st.replace(sending=st.sending - freed,
                    remote=rm.replace(ready=rm.ready | (hit & rm.valid)),
                    transfers=x.replace(active=x.active & ~end))
    return st, pool.replace(stalled=pool.stalled & ~wake), log


def _start_transfers(st: PDCluster, prof: ReplicaProfile, link: Link, info: dict, t, t_lo,
                     log: PDLog) -> tuple[PDCluster, PDLog]:
    """Moves the ready requests D admitted off the remote lists, appends the pending ones D
    allocated (in queue order) and starts their transfers, in D index then allocation order,
    each with the link share counted at its start (page section 7)."""
    rm, x = st.remote, st.transfers
    taken, alloc, w = info["taken"], info["alloc"], info["win"]
    r_n, n_x = rm.valid.shape
    rows = jnp.arange(r_n)[:, None]
    # Remote lists: survivors keep their order, the new allocations follow.
    keep = rm.valid & ~taken
    n_keep = keep.sum(-1).astype(jnp.int32)
    a_rank = n_keep[:, None] + cumsum(alloc.astype(jnp.int32)) - 1
    k_dest = jnp.where(keep, cumsum(keep.astype(jnp.int32)) - 1, n_x)
    a_dest = jnp.where(alloc, a_rank, n_x)
    over = (alloc & (a_rank >= n_x)).sum()

    def rebuild(old, new):
        # The fields stacked on a last axis: two scatters for all (XLA:CPU compiles each
        # scatter as a loop of its own).
        out = jnp.zeros(old.shape, old.dtype).at[rows, k_dest].set(old, mode="drop")
        return out.at[rows, a_dest].set(new.astype(old.dtype), mode="drop")

    rid_w = w["req_id"]
    count = jnp.minimum(n_keep + alloc.sum(-1).astype(jnp.int32), n_x)
    ints = rebuild(jnp.stack([(rm.ready & keep).astype(jnp.int32), rm.res, rm.prompt,
                              rm.output, rm.req_id], -1),
                   jnp.stack([jnp.zeros_like(rid_w), w["need"], w["prompt"],
                              w["output"].astype(jnp.int32), rid_w], -1))
    remote = RemoteList(
        valid=jnp.arange(n_x)[None, :] < count[:, None], ready=ints[..., 0] > 0,
        res=ints[..., 1], arrival=rebuild(rm.arrival[..., None], w["arrival"][..., None])[..., 0],
        prompt=ints[..., 2], output=ints[..., 3], req_id=ints[..., 4], count=count)
    # Transfers: the global start order is D index, then allocation (queue) order; each
    # takes the next free entry of the table.
    flat = alloc.ravel()
    g_rank = cumsum(flat.astype(jnp.int32)) - 1
    n_t = x.active.shape[0]
    free = ~x.active
    slot_of = jnp.full((n_t,), n_t, jnp.int32).at[
        jnp.where(free, cumsum(free.astype(jnp.int32)) - 1, n_t)].set(
        jnp.arange(n_t, dtype=jnp.int32), mode="drop")
    dest = jnp.where(flat & (g_rank < n_t), slot_of[jnp.clip(g_rank, 0, n_t - 1)], n_t)
    over = over + (flat & (dest >= n_t)).sum()
    rid = rid_w.ravel()
    src = jnp.maximum(st.tables.src[jnp.clip(rid, 0, st.tables.src.shape[0] - 1)], 0)
    b_p = prof.block_size[src]
    blocks = cdiv(w["prompt"].ravel(), b_p)
    nbytes = (blocks * b_p).astype(jnp.float32) * link.kv_bytes_per_token
    # BLIS counts the new transfer among the active ones before dividing the bandwidth.
    share = jnp.where(link.shared, x.active.sum().astype(jnp.float32)
                      + g_rank.astype(jnp.float32) + 1.0, 1.0)
    dur = link.base_latency + nbytes / (link.bandwidth / share)
    end_hi, end_lo = add_time(jnp.broadcast_to(t, dur.shape), jnp.broadcast_to(t_lo, dur.shape),
                              dur)
    d_of = jnp.broadcast_to(rows, alloc.shape).ravel().astype(jnp.int32)
    arr = w["arrival"].ravel()
    # One scatter per dtype into the table.
    fl = jnp.stack([x.end, x.end_lo, x.arrival], -1).at[dest].set(
        jnp.stack([end_hi, end_lo, arr], -1), mode="drop")
    it = jnp.stack([x.active.astype(jnp.int32), x.req_id, x.p, x.d, x.blocks], -1).at[dest].set(
        jnp.stack([flat.astype(jnp.int32), rid, src, d_of, blocks], -1), mode="drop")
    x = x.replace(active=it[:, 0] > 0, end=fl[:, 0], end_lo=fl[:, 1], arrival=fl[:, 2],
                  req_id=it[:, 1], p=it[:, 2], d=it[:, 3], blocks=it[:, 4])
    size = log.transfer_start.shape[0]
    log = log.replace(transfer_start=log.transfer_start.at[jnp.where(flat, rid, size)].set(
        (t - arr) + t_lo, mode="drop"))
    return st.replace(remote=remote, transfers=x,
                      overflow=st.overflow + over.astype(jnp.int32)), log


def _trip(carry, consts, width: int):
    """One instant of the cluster: the earliest event's time `t`; iteration ends (with the
    P -> D handovers, in P index order), transfer ends, and, before `horizon`, scheduling
    (with the transfers D's allocations start)."""
    st, log, m = carry
    prof, link, horizon = consts
    pool, x = st.pool, st.transfers
    inf = jnp.float32(jnp.inf)
    hi = jnp.concatenate([jnp.where(pool.in_iter, pool.t_end, inf),
                          jnp.where(x.active, x.end, inf),
                          jnp.where(_schedulable(st).any(), st.now, inf)[None]])
    lo = jnp.concatenate([pool.t_lo, x.end_lo, st.now_lo[None]])
    j = jnp.argmin(hi)
    t, t_lo = hi[j], lo[j]

    # 1. Iteration ends; a finished P request keeps its blocks for the send and hands over.
    end = pool.in_iter & (pool.t_end <= t)
    run = pool.run
    idx = jnp.arange(run.arrival.shape[-1])[None, :]
    done = ((idx < run.count[:, None]) & end[:, None] & st.is_prefill[:, None]
            & (run.sched > 0) & (run.comp + run.sched == run.prompt + run.gen)
            & (run.gen + 1 == run.output))
    sending = st.sending + jnp.where(done, cdiv(run.prompt, prof.block_size[:, None]),
                                     0).sum(-1)
    pool, m, _, reqs = _end_iteration(pool, end, inf, m, zero_extras(), log.requests)
    log = log.replace(requests=reqs)
    st, pool = _handover(st.replace(sending=sending, first_res=jnp.where(end, 0, st.first_res)),
                         pool, run, done)
    # 2. Transfer ends.
    st, pool, log = _end_transfers(st, pool, t, log)
    # 4. Scheduling (3., arrivals, happen between `advance` calls).
    st = st.replace(pool=pool)
    go = _schedulable(st) & (t < horizon)
    q_before = pool.queues
    pool, info = schedule_remote(pool, prof, go, jnp.broadcast_to(t, go.shape),
                                 jnp.broadcast_to(t_lo, go.shape), st.remote.as_dict(),
                                 st.q_pending, width, extra_used=st.sending)
    # Entries taken off the queues leave their slots: no slot outside a queue is pending.
    popped = Q.positions(q_before) < info["popped"][:, None]
    rm = st.remote
    extra = jnp.where(info["taken"], rm.res - cdiv(rm.prompt - 1, prof.block_size[:, None]),
                      0).sum(-1)
    st = st.replace(pool=pool, q_pending=st.q_pending & ~popped,
                    first_res=jnp.where(go, extra, st.first_res),
                    overflow=st.overflow + info["overflow"].sum().astype(jnp.int32))
    st, log = _start_transfers(st, prof, link, info, t, t_lo, log)
    return st.replace(now=t, now_lo=t_lo), log, m


def advance(st: PDCluster, prof: ReplicaProfile, link: Link, horizon: jax.Array, log: PDLog,
            width: int):
    """Runs the cluster from its current instant to `horizon` (s, relative) with no
    arrivals; `inf` drains. Processes iteration and transfer ends at `t <= horizon` and
    schedules at `t < horizon` (arrivals at `horizon` are routed after its ends, before its
    scheduling: page section 9). `prof` is `pool_profile`'s; `width` D's admission window
    (static, `scheduler.schedule_remote`). Does not rebase.

    Returns:
      (cluster, log, StepMetrics of the window over both pools: `completed` and
      `latency_sum` count P requests (to `prefill_done`) and D requests (to the finish)).
    """
    horizon = jnp.asarray(horizon, jnp.float32)
    st, log, m = compacted_while(lambda c, k: _due(c[0], k[2]),
                                 lambda c, k: _trip(c, k, width),
                                 (st, log, StepMetrics.zeros()), (prof, link, horizon))
    finite = jnp.isfinite(horizon)
    h = jnp.where(finite, horizon, 0.0)
    rep = st.pool
    # Busy time of iterations running across the horizon, as `continuous.advance`.
    part = jnp.where(rep.in_iter & finite, h - jnp.maximum(rep.t_start, 0.0), 0.0)
    rep = rep.replace(busy=rep.busy + part,
                      kv_block_s=rep.kv_block_s + part * rep.iter_blocks.astype(jnp.float32))
    m = m.replace(busy_time=m.busy_time + part.sum(), elapsed=jnp.where(finite, h, m.elapsed))
    later = finite & (h > st.now)
    return (st.replace(pool=rep, now=jnp.where(later, h, st.now),
                       now_lo=jnp.where(later, 0.0, st.now_lo)), log, m)


def rebase(st: PDCluster, dt: jax.Array) -> PDCluster:
    """Moves the clock origin `dt` seconds forward (every stored time minus `dt`)."""
    dt = jnp.asarray(dt, jnp.float32)
    x = st.transfers
    end, end_lo = add_time(x.end, x.end_lo, -dt)
    now, now_lo = add_time(st.now, st.now_lo, -dt)
    return st.replace(pool=rebase_replicas(st.pool, dt),
                      remote=st.remote.replace(arrival=st.remote.arrival - dt),
                      transfers=x.replace(end=end, end_lo=end_lo, arrival=x.arrival - dt),
                      now=now, now_lo=now_lo)


def replica_views(st: PDCluster, prof: ReplicaProfile) -> dict:
    """What a router may observe (page section 4), per row of the pool (`is_prefill` tells
    the P rows): `running`, `waiting` (including pending and remote requests, vLLM's
    `num_waiting_reqs`) `(R,)` int32, and `kv_usage` `(R,)` float32, blocks in use (running
    requests' `ceil(C / b)`, held for sends, reserved for receives) over `kv_blocks`: the
    reference's `ReplicaView`s (a running request counts `max(ceil(C / b), reserved)`,
    `C` its computed tokens before the iteration in progress)."""
    p, rm = st.pool, st.remote
    valid = jnp.arange(p.max_seqs)[None, :] < p.run.count[:, None]
    used = (jnp.where(valid, cdiv(p.run.comp, prof.block_size[:, None]), 0).sum(-1)
            + jnp.where(rm.valid, rm.res, 0).sum(-1) + st.sending + st.first_res)
    return {"running": p.run.count, "waiting": p.queues.count + rm.count,
            "kv_usage": used.astype(jnp.float32) / prof.kv_blocks.astype(jnp.float32),
            "is_prefill": st.is_prefill}
