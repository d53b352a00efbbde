"""Prefill/decode disaggregation: the JAX engine of `docs/disaggregation.md`.

A pool of P (prefill) and a pool of D (decode) continuous-batching replicas (`Replicas`, each
pool with its own stacked `ReplicaProfile`) and one KV-transfer link. Each replica runs the
colocated engine's scheduler (`scheduler.schedule`; a D replica `scheduler.schedule_remote`,
the same boundary with the page's remote list and pending requests) and ends its iterations
with the colocated `_end_iteration`; this module adds what crosses replicas:

* the P -> D handover: a P request of `(p, 1)` finishing appends its D request of `(p, o)`,
  *pending*, to the end of its D replica's waiting queue; P keeps `ceil(p / b_P)` blocks
  (`PDCluster.sending`) until the transfer ends;
* the transfers: started by D's admission (`schedule_remote` allocates a pending request's
  blocks), each lasting `base_latency + bytes / (bandwidth / n)` (`n` transfers in flight
  counting this one, when the link is shared; fixed at its start), `bytes = ceil(p / b_P) *
  b_P * kv_bytes_per_token`; at its end P frees the blocks and the D request becomes
  *ready* (it is then admitted for one token with `C = p - 1`);
* the event order at one instant (page section 9): iteration ends (P, then D), transfer
  ends, then (between `advance` calls) arrivals, then scheduling (P, then D; transfers start
  in D index order, then allocation order).

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

Static shapes (`empty_pd`): replica slots per pool, waiting buffers, the remote list (`X`
entries per D replica), the transfer table (`T` entries), the D admission window and the
per-request tables (`N` requests). A handover, remote entry or transfer that does not fit is
counted in `PDCluster.overflow` (results are then not the contract's; `simulate_disagg`
sizes everything so that it cannot happen and checks it).

Per-request tables: the P -> D handover reads the request's D replica, P replica and output
tokens from `PDTables` (indexed by request id), written by `route`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.core import queues as Q
from jaxserve.core.continuous import _end_iteration, rebase as rebase_replicas, zero_extras
from jaxserve.core.cpu_numerics import add_time, cdiv, cumsum
from jaxserve.core.lanes import active_order, compacted_while
from jaxserve.core.metrics import StepMetrics
from jaxserve.core.replica import ReplicaProfile
from jaxserve.core.replica_state import (Replicas, TokenLog, empty_log, empty_replicas,
                                         never_fits)
from jaxserve.core.scheduler import route as route_replica
from jaxserve.core.scheduler import schedule, schedule_remote

__all__ = ["Link", "make_link", "RemoteList", "Transfers", "PDTables", "PDLog", "PDCluster",
           "empty_pd", "empty_pd_log", "route", "advance", "rebase", "replica_views",
           "LINK_DEFAULTS"]

# BLIS's defaults (docs/disaggregation.md section 7): 25 GB/s, 0.05 ms, sharing as the page's
# Reading 6 (on); bytes per token 0 until a model is named.
LINK_DEFAULTS = {"bandwidth": 25e9, "base_latency": 0.05e-3, "kv_bytes_per_token": 0.0,
                 "shared": True}


@struct.dataclass
class Link:
    """The KV-transfer link (scalars). `bandwidth` bytes/s, `base_latency` s,
    `kv_bytes_per_token` bytes/token (float32); `shared` (bool): equal shares among the
    transfers in flight, fixed at a transfer's start."""

    bandwidth: jax.Array
    base_latency: jax.Array
    kv_bytes_per_token: jax.Array
    shared: jax.Array


def make_link(bandwidth=LINK_DEFAULTS["bandwidth"], base_latency=LINK_DEFAULTS["base_latency"],
              kv_bytes_per_token=LINK_DEFAULTS["kv_bytes_per_token"],
              shared=LINK_DEFAULTS["shared"]) -> Link:
    """A validated `Link` (host side). Raises ValueError: bandwidth not finite and > 0,
    latency or bytes per token negative or not finite, `shared` not a bool."""
    for name, v, low_ok in (("bandwidth", bandwidth, False), ("base_latency", base_latency, True),
                            ("kv_bytes_per_token", kv_bytes_per_token, True)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                                  np.floating)):
            raise ValueError(f"link {name} must be a number, got {v!r}")
        if not math.isfinite(float(v)) or float(v) < 0 or (not low_ok and float(v) == 0):
            raise ValueError(f"link {name} must be finite and {'>= 0' if low_ok else '> 0'}, "
                             f"got {v!r}")
    if not isinstance(shared, (bool, np.bool_)):
        raise ValueError(f"link shared must be a bool, got {shared!r}")
    return Link(bandwidth=jnp.float32(bandwidth), base_latency=jnp.float32(base_latency),
                kv_bytes_per_token=jnp.float32(kv_bytes_per_token), shared=jnp.bool_(shared))


@struct.dataclass
class RemoteList:
    """Each D replica's remote list (vLLM's `skipped_waiting`): D requests holding reserved
    blocks, receiving (transfer in flight) or ready (ended), in allocation order; `(R_D, X)`
    arrays, entry `x` valid when `x < count`.

    Attributes: `valid`, `ready` (bool); `res` reserved blocks (`ceil(p / b_D)`); `arrival`
    (relative s, the request's arrival); `prompt`, `output` (tokens), `req_id` (int32);
    `count` `(R_D,)`.
    """

    valid: jax.Array
    ready: jax.Array
    res: jax.Array
    arrival: jax.Array
    prompt: jax.Array
    output: jax.Array
    req_id: jax.Array
    count: jax.Array

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in ("valid", "ready", "res", "arrival", "prompt",
                                              "output", "req_id")}


@struct.dataclass
class Transfers:
    """Transfers in flight, a table of `T` entries (`active` marks the used ones).

    Attributes: `end`, `end_lo` (relative s, compensated pair); `arrival` (relative s, the
    request's); `req_id`, `p`, `d` (its P and D replicas), `blocks` (P blocks it moves, freed
    on P at its end). `(T,)` each.
    """

    active: jax.Array
    end: jax.Array
    end_lo: jax.Array
    arrival: jax.Array
    req_id: jax.Array
    p: jax.Array
    d: jax.Array
    blocks: jax.Array


@struct.dataclass
class PDTables:
    """Per-request routing, written at arrival (`(N,)` int32): `src` the P replica (-1: not
    disaggregated), `dest` the D replica, `output` the request's output tokens (the D request
    generates them; the P request only one)."""

    src: jax.Array
    dest: jax.Array
    output: jax.Array


@struct.dataclass
class PDLog:
    """Per-request outcome, spans from the request's arrival (s; NaN until it happens).

    Attributes:
      prefill: P's `TokenLog`: `ttft` = `e2e` = P's sample (`prefill_done`), `preemptions`
        on P.
      decode: D's `TokenLog`: `ttft` the client's first token (D's first sample), `e2e` the
        finish, `preemptions` on D (a request not disaggregated runs only there).
      transfer_start, transfer_end: `(N,)` float32.
    """

    prefill: TokenLog
    decode: TokenLog
    transfer_start: jax.Array
    transfer_end: jax.Array


@struct.dataclass
class PDCluster:
    """The disaggregated cluster.

    Attributes:
      prefill, decode: the pools (`Replicas`).
      sending: `(R_P,)` blocks each P replica holds for sends (finished P requests whose
        transfer has not ended). int32.
      remote: D's remote lists.
      q_pending: `(R_D, W)` bool over D's waiting ring slots: pending D requests (False on
        every slot not holding a waiting request).
      transfers: the link's transfers in flight.
      now, now_lo: the current instant (relative s, compensated pair).
      overflow: static-size overflows so far (0 in a valid run). int32.
      tables: per-request routing.
    """

    prefill: Replicas
    decode: Replicas
    sending: jax.Array
    remote: RemoteList
    q_pending: jax.Array
    transfers: Transfers
    now: jax.Array
    now_lo: jax.Array
    overflow: jax.Array
    tables: PDTables


def empty_pd(num_prefill: int, num_decode: int, *, prefill_queue: int, decode_queue: int,
             prefill_seqs: int, decode_seqs: int, remote_slots: int, transfer_slots: int,
             num_requests: int) -> PDCluster:
    """An idle cluster. `prefill_queue`, `decode_queue`: waiting buffers beyond the running
    slots (`empty_replicas`' `queue_buffer`; D's must also hold pending D requests, which no
    queue cap bounds); `prefill_seqs`, `decode_seqs`: running slots (the pools' largest
    `max_seqs`); `remote_slots`: remote entries per D replica; `transfer_slots`: transfers in
    flight; `num_requests`: the per-request tables' length."""
    for name, v in (("num_prefill", num_prefill), ("num_decode", num_decode),
                    ("prefill_seqs", prefill_seqs), ("decode_seqs", decode_seqs),
                    ("remote_slots", remote_slots), ("transfer_slots", transfer_slots),
                    ("num_requests", num_requests)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    rp, rd, x, t = int(num_prefill), int(num_decode), int(remote_slots), int(transfer_slots)
    dec = empty_replicas(rd, decode_queue, decode_seqs, with_ids=True)
    zx = jnp.zeros((rd, x), jnp.int32)
    fx = jnp.zeros((rd, x), jnp.bool_)
    zt = jnp.zeros((t,), jnp.int32)
    n = int(num_requests)
    return PDCluster(
        prefill=empty_replicas(rp, prefill_queue, prefill_seqs, with_ids=True), decode=dec,
        sending=jnp.zeros((rp,), jnp.int32),
        remote=RemoteList(valid=fx, ready=fx, res=zx, arrival=jnp.zeros((rd, x), jnp.float32),
                          prompt=zx, output=zx, req_id=zx, count=jnp.zeros((rd,), jnp.int32)),
        q_pending=jnp.zeros(dec.q_gen.shape, jnp.bool_),
        transfers=Transfers(active=jnp.zeros((t,), jnp.bool_), end=jnp.zeros((t,), jnp.float32),
                            end_lo=jnp.zeros((t,), jnp.float32),
                            arrival=jnp.zeros((t,), jnp.float32), req_id=zt, p=zt, d=zt,
                            blocks=zt),
        now=jnp.float32(0.0), now_lo=jnp.float32(0.0), overflow=jnp.int32(0),
        tables=PDTables(src=jnp.full((n,), -1, jnp.int32), dest=jnp.zeros((n,), jnp.int32),
                        output=jnp.zeros((n,), jnp.int32)))


def empty_pd_log(num_requests: int) -> PDLog:
    """A log of `num_requests` requests, nothing happened yet."""
    nan = jnp.full((num_requests,), jnp.nan, jnp.float32)
    return PDLog(prefill=empty_log(num_requests), decode=empty_log(num_requests),
                 transfer_start=nan, transfer_end=nan)


def route(st: PDCluster, prof_p: ReplicaProfile, prof_d: ReplicaProfile, req: Q.Request,
          p_idx: jax.Array, d_idx: jax.Array, enabled: jax.Array | bool = True):
    """Routes an arriving request (at the current instant): to P replica `p_idx` as a P
    request of `(p, 1)`, its D request later to `d_idx`; or, with `p_idx < 0`, entirely to D
    replica `d_idx` as a colocated request (page sections 3-5).

    Drops (page section 5): disaggregated, when it could never fit P as `(p, 1)` or D as
    `(p, o)`, or P's waiting queue holds `queue_cap` requests never preempted; not
    disaggregated, as the colocated engine on `d_idx` (pending D requests count as waiting).
    `req.req_id` indexes the per-request tables; `req.output` is `o`. Where `enabled` is
    False nothing changes.

    Returns:
      (cluster, dropped, never_fit): bool scalars.
    """
    p_idx = jnp.asarray(p_idx, jnp.int32)
    d_idx = jnp.asarray(d_idx, jnp.int32)
    dis = p_idx >= 0
    rid = jnp.where(enabled, req.req_id, st.tables.src.shape[0])  # out of range: dropped
    tables = st.tables.replace(
        src=st.tables.src.at[rid].set(p_idx, mode="drop"),
        dest=st.tables.dest.at[rid].set(d_idx, mode="drop"),
        output=st.tables.output.at[rid].set(req.output.astype(jnp.int32), mode="drop"))
    pd1 = jax.tree.map(lambda x: x[d_idx], prof_d)
    d_never = never_fits(pd1, req.prompt, req.output)
    p_req = req.replace(output=jnp.ones_like(req.output))
    pre, drop_p, never_p = route_replica(st.prefill, prof_p, p_req, jnp.maximum(p_idx, 0),
                                         enabled & dis & ~d_never)
    dec, drop_d, never_d = route_replica(st.decode, prof_d, req, d_idx, enabled & ~dis)
    dropped = jnp.where(dis, drop_p, drop_d)
    never = jnp.where(dis, never_p | d_never, never_d)
    return st.replace(prefill=pre, decode=dec, tables=tables), dropped, never


def _has_work(rep: Replicas) -> jax.Array:
    return (rep.queues.count + rep.run.count) > 0


def _schedulable(st: PDCluster):
    """Replicas that would schedule at the current instant: idle, not stalled, with work (a
    D replica's ready remote requests are work)."""
    p, d = st.prefill, st.decode
    ready = (st.remote.valid & st.remote.ready).any(-1)
    return (~p.in_iter & ~p.stalled & _has_work(p),
            ~d.in_iter & ~d.stalled & (_has_work(d) | ready))


def _due(st: PDCluster, horizon) -> jax.Array:
    """Whether an event is due by `horizon`: an iteration or transfer ending at or before it,
    or a replica able to schedule before it."""
    sp, sd = _schedulable(st)
    x = st.transfers
    return ((st.prefill.in_iter & (st.prefill.t_end <= horizon)).any()
            | (st.decode.in_iter & (st.decode.t_end <= horizon)).any()
            | (x.active & (x.end <= horizon)).any()
            | ((sp.any() | sd.any()) & (st.now < horizon)))


def _handover(st: PDCluster, dec: Replicas, run, done: jax.Array) -> tuple[PDCluster, Replicas]:
    """Appends the D request of every finished P request (`done` `(R_P, S_P)` over the P
    running slots `run`, before compaction) to its D replica's waiting queue, pending, in P
    index then slot order; wakes those D replicas."""
    s_p = done.shape[-1]
    order, num = active_order(done, done.size)
    cap = dec.queues.capacity
    limit = jnp.full(dec.queues.count.shape, cap, jnp.int32)

    def push(k, c):
        dq, qgen, qpre, qpend, stalled, over = c
        flat = order[k]
        r, s = flat // s_p, flat % s_p
        rid = run.req_id[r, s]
        d = st.tables.dest[rid]
        req = Q.Request(arrival=run.arrival[r, s], prompt=run.prompt[r, s].astype(jnp.float32),
                        output=st.tables.output[rid].astype(jnp.float32),
                        estimate=jnp.float32(0.0), size_class=jnp.int32(0), req_id=rid)
        slot = (dq.head[d] + dq.count[d]) % cap
        dq, ok = Q.push(dq, d, req, limit, jnp.float32(0.0))
        at = jnp.where(ok, slot, cap)
        return (dq, qgen.at[d, at].set(0, mode="drop"), qpre.at[d, at].set(0, mode="drop"),
                qpend.at[d, at].set(True, mode="drop"), stalled.at[d].set(False),
                over + (~ok).astype(jnp.int32))

    dq, qgen, qpre, qpend, stalled, over = jax.lax.fori_loop(
        0, num, push, (dec.queues, dec.q_gen, dec.q_pre, st.q_pending, dec.stalled,
                       st.overflow))
    dec = dec.replace(queues=dq, q_gen=qgen, q_pre=qpre, stalled=stalled)
    return st.replace(q_pending=qpend, overflow=over), dec


def _end_transfers(st: PDCluster, pre: Replicas, dec: Replicas, t, log: PDLog):
    """Ends every transfer due at `t`: P frees its blocks, the D request becomes ready; both
    replicas wake (page section 3, step 7)."""
    x = st.transfers
    end = x.active & (x.end <= t)
    r_p, r_d = pre.num_replicas, dec.num_replicas
    freed = jnp.zeros((r_p,), jnp.int32).at[x.p].add(jnp.where(end, x.blocks, 0))
    wake_p = jnp.zeros((r_p,), jnp.bool_).at[jnp.where(end, x.p, r_p)].set(True, mode="drop")
    wake_d = jnp.zeros((r_d,), jnp.bool_).at[jnp.where(end, x.d, r_d)].set(True, mode="drop")
    rm = st.remote
    rows = jnp.arange(r_d, dtype=jnp.int32)[:, None, None]
    hit = (end[None, None, :] & (x.d[None, None, :] == rows)
           & (x.req_id[None, None, :] == rm.req_id[:, :, None])).any(-1)
    size = log.transfer_end.shape[0]
    ids = jnp.where(end, x.req_id, size)
    log = log.replace(transfer_end=log.transfer_end.at[ids].set((x.end - x.arrival) + x.end_lo,
                                                                mode="drop"))
    st = st.replace(sending=st.sending - freed, remote=rm.replace(ready=rm.ready | (hit & rm.valid)),
                    transfers=x.replace(active=x.active & ~end))
    return (st, pre.replace(stalled=pre.stalled & ~wake_p),
            dec.replace(stalled=dec.stalled & ~wake_d), log)


def _start_transfers(st: PDCluster, prof_p: ReplicaProfile, link: Link, dec_info: dict, t,
                     t_lo, log: PDLog) -> tuple[PDCluster, PDLog]:
    """Moves the ready requests D admitted off the remote lists, appends the pending ones D
    allocated (in queue order) and starts their transfers, in D index then allocation order,
    each with the link share counted at its start (page section 7)."""
    rm, x = st.remote, st.transfers
    taken, alloc, w = dec_info["taken"], dec_info["alloc"], dec_info["win"]
    r_d, n_x = rm.valid.shape
    rows = jnp.arange(r_d)[:, None]
    # Remote lists: survivors keep their order, the new allocations follow.
    keep = rm.valid & ~taken
    k_rank = cumsum(keep.astype(jnp.int32)) - 1
    n_keep = keep.sum(-1).astype(jnp.int32)
    a_rank = n_keep[:, None] + cumsum(alloc.astype(jnp.int32)) - 1
    k_dest = jnp.where(keep, k_rank, n_x)
    a_dest = jnp.where(alloc, a_rank, n_x)
    over = (alloc & (a_rank >= n_x)).sum()

    def rebuild(old, new, fill=0):
        out = jnp.full(old.shape, fill, old.dtype)
        out = out.at[rows, k_dest].set(old, mode="drop")
        return out.at[rows, a_dest].set(new.astype(old.dtype), mode="drop")

    rid_w = w["req_id"]
    count = jnp.minimum(n_keep + alloc.sum(-1).astype(jnp.int32), n_x)
    remote = RemoteList(
        valid=jnp.arange(n_x)[None, :] < count[:, None],
        ready=rebuild(rm.ready & keep, jnp.zeros_like(alloc)),
        res=rebuild(rm.res, w["need"]), arrival=rebuild(rm.arrival, w["arrival"]),
        prompt=rebuild(rm.prompt, w["prompt"]), output=rebuild(rm.output, w["output"]),
        req_id=rebuild(rm.req_id, rid_w), count=count)
    # Transfers: global start order is D index, then allocation (queue) order.
    flat = alloc.ravel()
    g_rank = cumsum(flat.astype(jnp.int32)) - 1
    n_t = x.active.shape[0]
    free = ~x.active
    f_rank = cumsum(free.astype(jnp.int32)) - 1
    slot_of = jnp.full((n_t,), n_t, jnp.int32).at[jnp.where(free, f_rank, n_t)].set(
        jnp.arange(n_t, dtype=jnp.int32), mode="drop")
    dest = jnp.where(flat, slot_of[jnp.clip(g_rank, 0, n_t - 1)], n_t)
    dest = jnp.where(flat & (g_rank >= n_t), n_t, dest)
    over = over + (flat & (dest >= n_t)).sum()
    rid = rid_w.ravel()
    src = st.tables.src[jnp.clip(rid, 0, st.tables.src.shape[0] - 1)]
    src = jnp.maximum(src, 0)
    b_p = prof_p.block_size[src]
    blocks = cdiv(w["prompt"].ravel(), b_p)
    nbytes = (blocks * b_p).astype(jnp.float32) * link.kv_bytes_per_token
    n_active = x.active.sum().astype(jnp.float32)
    share = jnp.where(link.shared, n_active + g_rank.astype(jnp.float32) + 1.0, 1.0)
    dur = link.base_latency + nbytes / (link.bandwidth / share)
    end_hi, end_lo = add_time(jnp.broadcast_to(t, dur.shape), jnp.broadcast_to(t_lo, dur.shape),
                              dur)
    d_of = jnp.broadcast_to(rows, alloc.shape).ravel().astype(jnp.int32)
    arr = w["arrival"].ravel()
    put = lambda a, v: a.at[dest].set(v.astype(a.dtype), mode="drop")  # noqa: E731
    x = x.replace(active=put(x.active, flat), end=put(x.end, end_hi), end_lo=put(x.end_lo, end_lo),
                  arrival=put(x.arrival, arr), req_id=put(x.req_id, rid), p=put(x.p, src),
                  d=put(x.d, d_of), blocks=put(x.blocks, blocks))
    size = log.transfer_start.shape[0]
    ids = jnp.where(flat, rid, size)
    log = log.replace(transfer_start=log.transfer_start.at[ids].set(
        (t - arr) + t_lo, mode="drop"))
    return st.replace(remote=remote, transfers=x,
                      overflow=st.overflow + over.astype(jnp.int32)), log


def _trip(carry, consts, width: int):
    """One instant of the cluster: the earliest event's time `t`; iteration ends (P, then D,
    with the handovers), transfer ends, and, before `horizon`, scheduling (P, then D, with
    the transfers D's allocations start)."""
    st, log, mp, md = carry
    prof_p, prof_d, link, horizon = consts
    pre, dec, x = st.prefill, st.decode, st.transfers
    inf = jnp.float32(jnp.inf)
    sp, sd = _schedulable(st)
    hi = jnp.concatenate([jnp.where(pre.in_iter, pre.t_end, inf),
                          jnp.where(dec.in_iter, dec.t_end, inf),
                          jnp.where(x.active, x.end, inf),
                          jnp.where(sp.any() | sd.any(), st.now, inf)[None]])
    lo = jnp.concatenate([pre.t_lo, dec.t_lo, x.end_lo, st.now_lo[None]])
    j = jnp.argmin(hi)
    t, t_lo = hi[j], lo[j]

    # 1. Iteration ends, P then D; a finished P request hands over to D.
    end_p = pre.in_iter & (pre.t_end <= t)
    run = pre.run
    idx = jnp.arange(run.arrival.shape[-1])[None, :]
    sampled = ((idx < run.count[:, None]) & end_p[:, None] & (run.sched > 0)
               & (run.comp + run.sched == run.prompt + run.gen))
    done = sampled & (run.gen + 1 == run.output)
    sending = st.sending + jnp.where(done, cdiv(run.prompt, prof_p.block_size[:, None]),
                                     0).sum(-1)
    ex0 = zero_extras()
    pre, mp, _, plog = _end_iteration(pre, end_p, inf, mp, ex0, log.prefill)
    st, dec = _handover(st.replace(sending=sending), dec, run, done)
    end_d = dec.in_iter & (dec.t_end <= t)
    dec, md, _, dlog = _end_iteration(dec, end_d, inf, md, ex0, log.decode)
    log = log.replace(prefill=plog, decode=dlog)
    # 2. Transfer ends.
    st, pre, dec, log = _end_transfers(st, pre, dec, t, log)
    # 4. Scheduling (3., arrivals, happen between `advance` calls).
    st = st.replace(prefill=pre, decode=dec)
    sp, sd = _schedulable(st)
    before = t < horizon
    go_p, go_d = sp & before, sd & before
    tp = jnp.broadcast_to(t, go_p.shape)
    pre = schedule(pre, prof_p, go_p, tp, jnp.broadcast_to(t_lo, go_p.shape),
                   extra_used=st.sending)
    td = jnp.broadcast_to(t, go_d.shape)
    q_before = dec.queues
    dec, info = schedule_remote(dec, prof_d, go_d, td, jnp.broadcast_to(t_lo, go_d.shape),
                                st.remote.as_dict(), st.q_pending, width)
    # Entries taken off D's queues leave their slots: no slot outside the queue is pending.
    popped_slot = Q.positions(q_before) < info["popped"][:, None]
    st = st.replace(prefill=pre, decode=dec, q_pending=st.q_pending & ~popped_slot,
                    overflow=st.overflow + info["overflow"].sum().astype(jnp.int32))
    st, log = _start_transfers(st, prof_p, link, info, t, t_lo, log)
    st = st.replace(now=t, now_lo=t_lo)
    return st, log, mp, md


def advance(st: PDCluster, prof_p: ReplicaProfile, prof_d: ReplicaProfile, link: Link,
            horizon: jax.Array, log: PDLog, width: int):
    """Runs the cluster from its current instant to `horizon` (s, relative) with no
    arrivals; `inf` drains. Processes iteration and transfer ends at `t <= horizon` and
    schedules at `t < horizon` (arrivals at `horizon` are routed after its ends, before its
    scheduling: page section 9). `width`: D's admission window (static, see
    `scheduler.schedule_remote`). Does not rebase.

    Returns:
      (cluster, log, StepMetrics of the P pool, StepMetrics of the D pool): the pools'
      `completed`, `latency_sum` (P: to `prefill_done`; D: to the finish), `busy_time` in the
      window.
    """
    horizon = jnp.asarray(horizon, jnp.float32)
    consts = (prof_p, prof_d, link, horizon)
    carry = (st, log, StepMetrics.zeros(), StepMetrics.zeros())
    st, log, mp, md = compacted_while(lambda c, k: _due(c[0], k[3]),
                                      lambda c, k: _trip(c, k, width), carry, consts)
    finite = jnp.isfinite(horizon)
    h = jnp.where(finite, horizon, 0.0)

    def close(rep, m):  # the busy time of iterations running across the horizon
        part = jnp.where(rep.in_iter & finite, h - jnp.maximum(rep.t_start, 0.0), 0.0)
        rep = rep.replace(busy=rep.busy + part,
                          kv_block_s=rep.kv_block_s + part * rep.iter_blocks.astype(jnp.float32))
        return rep, m.replace(busy_time=m.busy_time + part.sum(),
                              elapsed=jnp.where(finite, h, m.elapsed))

    pre, mp = close(st.prefill, mp)
    dec, md = close(st.decode, md)
    st = st.replace(prefill=pre, decode=dec,
                    now=jnp.where(finite, jnp.maximum(st.now, h), st.now),
                    now_lo=jnp.where(finite & (h > st.now), 0.0, st.now_lo))
    return st, log, mp, md


def rebase(st: PDCluster, dt: jax.Array) -> PDCluster:
    """Moves the clock origin `dt` seconds forward (every stored time minus `dt`)."""
    dt = jnp.asarray(dt, jnp.float32)
    x = st.transfers
    end, end_lo = add_time(x.end, x.end_lo, -dt)
    now, now_lo = add_time(st.now, st.now_lo, -dt)
    return st.replace(prefill=rebase_replicas(st.prefill, dt),
                      decode=rebase_replicas(st.decode, dt),
                      remote=st.remote.replace(arrival=st.remote.arrival - dt),
                      transfers=x.replace(end=end, end_lo=end_lo, arrival=x.arrival - dt),
                      now=now, now_lo=now_lo)


def replica_views(st: PDCluster, prof_p: ReplicaProfile, prof_d: ReplicaProfile) -> dict:
    """What a router may observe (page section 4), per pool: `running`, `waiting` (D:
    including pending and remote requests, vLLM's `num_waiting_reqs`) `(R,)` int32, and
    `kv_usage` `(R,)` float32, blocks in use (running requests', held for sends on P,
    reserved for receives on D) over `kv_blocks`. The reference's `ReplicaView`s."""
    def used(rep, prof):
        valid = jnp.arange(rep.max_seqs)[None, :] < rep.run.count[:, None]
        return jnp.where(valid, cdiv(rep.run.comp, prof.block_size[:, None]), 0).sum(-1)

    rm = st.remote
    reserved = jnp.where(rm.valid, rm.res, 0).sum(-1)
    p, d = st.prefill, st.decode
    return {"prefill": {"running": p.run.count, "waiting": p.queues.count,
                        "kv_usage": (used(p, prof_p) + st.sending).astype(jnp.float32)
                        / prof_p.kv_blocks.astype(jnp.float32)},
            "decode": {"running": d.run.count, "waiting": d.queues.count + rm.count,
                       "kv_usage": (used(d, prof_d) + reserved).astype(jnp.float32)
                       / prof_d.kv_blocks.astype(jnp.float32)}}
