"""Event-by-event reference of prefill/decode disaggregation, `docs/disaggregation.md`.

Plain Python and numpy, float64, written from the page (not from any JAX code). A pool of P
(prefill) replicas and a pool of D (decode) replicas are continuous-batching replicas of
`docs/contract_continuous.md` (the replica of `jaxserve/reference/continuous.py`, reused by
subclassing) with the page's additions:

* A disaggregated request runs on P as a request of `(p, 1)`. When P samples its one token
  (`prefill_done`), P keeps its `ceil(p / b)` blocks until the transfer ends, and the D request
  of `(p, o)` joins the end of its D replica's `waiting` queue as *pending*.
* D allocates `ceil(p / b)` blocks for a pending request when its admission loop reaches it
  (no token budget, no running slot); the transfer starts then and lasts
  `base_latency + bytes / (bandwidth / n)` (`n` transfers in flight counting this one, when the
  link is shared), `bytes = ceil(p / b_P) * b_P * kv_bytes_per_token`.
* At the transfer end P frees the blocks and the D request becomes *ready*: it has `C = p - 1`
  computed tokens, and D's admission, which visits the remote list before `waiting`, schedules
  it for one token; its first sample is the client's first token. Then it decodes, with
  recompute preemption, as a colocated request.
* A request the decider does not disaggregate runs entirely on its D replica, exactly as in
  `jaxserve/reference/continuous.py`.
* Event order at one instant: iteration ends (P replicas, then D replicas, in index order),
  transfer ends (in start order), arrivals (index order), scheduling (P replicas, then D
  replicas, in index order; transfers start here). A D boundary that preempted and
  scheduled nothing (a running pass whose victims were all of `running`, blocks being held
  by reservations and sends) is followed by another at the same instant: the instant is run
  again, with no new arrival, after every boundary of the first round.
* Queue cap of a request not disaggregated, at D: the requests D holds that have not started
  running (waiting and never preempted, pending ones included, plus the remote list).
"""

from __future__ import annotations

import heapq
import math
from collections import namedtuple

import numpy as np

from jaxserve.reference.continuous import _Replica, _Req

ReplicaView = namedtuple("ReplicaView", "running waiting kv_usage")
ReplicaView.__doc__ = """What a router may observe of one replica (vLLM's exported counts):
`running` requests, `waiting` requests (including D requests pending or receiving KV) and
`kv_usage`, the fraction of the replica's KV blocks in use (including blocks held for a send or
reserved for a receive)."""

LINK_DEFAULTS = {"bandwidth": 25e9, "base_latency": 0.05e-3, "kv_bytes_per_token": 0.0,
                 "shared": True}


class _PDReq(_Req):
    """A request on one replica: a P request `(p, 1)`, a D request `(p, o)` or a colocated one.
    `res`: blocks reserved for the remote KV (D, until preempted or complete); `pending`: a D
    request whose blocks are not yet allocated; `ready`: its transfer has ended."""

    __slots__ = ("res", "pending", "ready")

    def __init__(self, i, a, p, o):
        super().__init__(i, a, p, o)
        self.res = 0
        self.pending = False
        self.ready = False


class _PDReplica(_Replica):
    """A continuous-batching replica with the page's P and D additions: `sending` blocks held
    for sends (P), and a `remote` list of D requests holding reserved blocks, in allocation
    order (vLLM's `skipped_waiting`)."""

    def __init__(self, prof, step_time=None):
        super().__init__(prof, step_time)
        self.sending = 0
        self.remote = []
        self.started = []  # D requests whose transfer the last `schedule` started

    def held(self, r):
        """Blocks a running request holds: its computed tokens' blocks, or its reservation
        while that is larger (vLLM allocated `ceil(p / b)` and `C = p - 1` gives none back)."""
        return max(self.blocks(r.C), r.res)

    def used(self):
        """KV blocks in use: running requests', reserved for receives, held for sends."""
        return (sum(self.held(r) for r in self.running) + sum(r.res for r in self.remote)
                + self.sending)

    def has_work(self):
        return bool(self.waiting or self.running or any(r.ready for r in self.remote))

    def not_started(self):
        """Requests held that have not started running, for the queue cap (page section 5):
        waiting ones never preempted (fresh and pending) and the remote list's (receiving or
        ready; never preempted either)."""
        return self.fresh_waiting() + len(self.remote)

    def view(self):
        return ReplicaView(len(self.running), len(self.waiting) + len(self.remote),
                           self.used() / self.M)

    def requeue_preempted(self, v):
        # A preempted request gives back its reservation with its blocks and recomputes
        # locally: the connector triggers only one transfer per request.
        v.res = 0
        super().requeue_preempted(v)

    def schedule(self, t):
        """One iteration boundary at `t` (s): `_Replica.schedule` with blocks held as `held`
        and the admission of `admit` (the transfers it starts are listed in `started`)."""
        self.started = []
        super().schedule(t)

    def admit(self, sched, free, k):
        """Admission visiting the remote list before `waiting`: a ready request is scheduled
        for its remaining prompt token(s) (its blocks already reserved), a receiving one is
        skipped; at the head of `waiting`, a pending D request is allocated `ceil(p / b)`
        blocks and its transfer starts (no token budget, no running slot), any other head is
        admitted as in the colocated engine (`admit_head`). With no remote requests this is
        `_Replica.admit` exactly."""
        j = 0  # next remote request to visit in this pass
        while k > 0 and (j < len(self.remote) or self.waiting):
            if len(self.running) >= self.S:
                break
            if j < len(self.remote):
                r = self.remote[j]
                if not r.ready:
                    j += 1
                    continue
                n = r.L - r.C
                extra = max(self.blocks(r.C + n) - r.res, 0)
                if free - extra < self.wm:
                    break
                self.remote.pop(j)
                self.running.append(r)
                sched.append((r, n))
                k -= n
                free -= extra
                continue
            h = self.waiting[0]
            if h.pending:
                need = self.blocks(h.p)
                if free - need < self.wm:
                    break
                self.waiting.popleft()
                h.pending = False
                h.res = need
                self.remote.append(h)
                j = len(self.remote)  # allocated in this pass: not visited again
                self.started.append(h)
                free -= need
                continue
            admitted, free, k = self.admit_head(sched, free, k)
            if not admitted:
                break

    def blocks_in_iteration(self, n_of):
        """Blocks held during the iteration: running requests' after their new tokens (or
        their reservation while larger), reserved for receives, held for sends."""
        return (sum(max(self.blocks(r.C + n_of.get(id(r), 0)), r.res) for r in self.running)
                + sum(r.res for r in self.remote) + self.sending)

    def finish_iteration(self, t):
        """Ends the iteration at `t` (s); returns the requests that completed, in schedule
        order."""
        sched = [r for r, _ in self.scheduled]
        super().finish_iteration(t)
        return [r for r in sched if r.finish == t]


def _rule(rule, name):
    if callable(rule):
        return rule
    arr = np.asarray(rule, dtype=np.int64)
    if name == "prefill":
        return lambda i, view, d: int(arr[i])
    return lambda i, view: int(arr[i])


def simulate(arrival, prompt, output, prefill_profiles, decode_profiles, prefill_route,
             decode_route, link=None, step_time=None):
    """Simulates disaggregated serving of the requests on P and D pools and one link.

    Args:
      arrival, prompt, output: per-request arrays: arrival time (s, non-decreasing), prompt and
        output tokens (each >= 1).
      prefill_profiles, decode_profiles: lists of replica profiles (dicts with
        `continuous.REPLICA_KEYS`); the P pool may be empty.
      decode_route: the D choice, made first at arrival: an int array (replica per request) or
        `decode_route(i, view) -> d`.
      prefill_route: the decider and P choice, made second: an int array (P replica per
        request, -1 for not disaggregated) or `prefill_route(i, view, d) -> P index or -1`.
        `view` is a dict: `prompt` (tokens of request `i`), `prefill` and `decode` (lists of
        `ReplicaView`, the state at that instant).
      link: dict: `bandwidth` (bytes/s), `base_latency` (s), `kv_bytes_per_token`
        (bytes/token), `shared` (bool: equal shares among the transfers in flight, fixed at a
        transfer's start); missing keys take `LINK_DEFAULTS` (BLIS's 25 GB/s and 0.05 ms).
      step_time: optional `step_time(prefills, decodes) -> seconds` replacing the iteration-time
        formula on every replica (as in `continuous.simulate`).

    Returns:
      dict of per-request arrays: `p_replica` (-1 if not disaggregated or dropped before
      routing to P), `d_replica`, `prefill_done` (P's sample, s), `transfer_start`,
      `transfer_end` (s), `first_token` (the client's first token, on D, s), `finish` (s),
      `preemptions` (P and D), `dropped`, `never_fit` (NaN times where they did not happen);
      and per pool `prefill_iterations`, `decode_iterations`, `prefill_busy`, `decode_busy` (s),
      `prefill_preemptions`, `decode_preemptions`.
    """
    lk = dict(LINK_DEFAULTS)
    lk.update(link or {})
    n = len(arrival)
    P = [_PDReplica(p, step_time) for p in prefill_profiles]
    D = [_PDReplica(p, step_time) for p in decode_profiles]
    p_rule, d_rule = _rule(prefill_route, "prefill"), _rule(decode_route, "decode")
    nan = float("nan")
    p_rep = np.full(n, -1, np.int64)
    d_rep = np.full(n, -1, np.int64)
    prefill_done = np.full(n, nan)
    t_start = np.full(n, nan)
    t_end = np.full(n, nan)
    dropped = np.zeros(n, bool)
    never = np.zeros(n, bool)
    p_req = [None] * n
    d_req = [None] * n
    transfers = []  # heap of (end, start order, request index)
    seq = 0
    active = 0
    nxt = 0

    def view(i):
        return {"prompt": int(prompt[i]), "prefill": [rp.view() for rp in P],
                "decode": [rp.view() for rp in D]}

    while True:
        ends = [rp.end for rp in P + D if rp.end is not None]
        if transfers:
            ends.append(transfers[0][0])
        if any(rp.has_boundary() for rp in P + D):
            # A boundary that preempted and scheduled nothing (page section 8, step 3): the
            # instant `t` is run again (no new arrival), after every boundary of this one.
            ends.append(t)
        t = min(ends + [float(arrival[nxt]) if nxt < n else math.inf])
        if t == math.inf:
            break
        # 1. Iteration ends; a P request that sampled its token hands over to D.
        for rp in P:
            if rp.end is not None and rp.end == t:
                for r in rp.finish_iteration(t):
                    i = r.i
                    prefill_done[i] = t
                    rp.sending += rp.blocks(r.C)
                    dq = _PDReq(i, r.a, r.p, int(output[i]))
                    dq.pending = True
                    d_req[i] = dq
                    D[d_rep[i]].waiting.append(dq)
                    D[d_rep[i]].stalled = False
        for rp in D:
            if rp.end is not None and rp.end == t:
                rp.finish_iteration(t)
        # 2. Transfer ends: P frees the blocks, D may schedule the request.
        while transfers and transfers[0][0] == t:
            _, _, i = heapq.heappop(transfers)
            active -= 1
            t_end[i] = t
            pr = P[p_rep[i]]
            pr.sending -= pr.blocks(p_req[i].C)
            pr.stalled = False
            dq = d_req[i]
            dq.ready = True
            dq.C = dq.p - 1  # the last prompt token is recomputed to sample the first token
            D[d_rep[i]].stalled = False
        # 3. Arrivals: D first, then the decider and P.
        while nxt < n and float(arrival[nxt]) == t:
            i = nxt
            nxt += 1
            p_i, o_i = int(prompt[i]), int(output[i])
            d = int(d_rule(i, view(i)) if callable(decode_route) else d_rule(i, None))
            d_rep[i] = d
            pj = int(p_rule(i, view(i), d) if callable(prefill_route) else p_rule(i, None, d))
            dr = D[d]
            if pj < 0:
                if dr.never_fits(p_i, o_i):
                    dropped[i] = never[i] = True
                elif dr.not_started() >= dr.Q:
                    dropped[i] = True
                else:
                    q = _PDReq(i, t, p_i, o_i)
                    d_req[i] = q
                    dr.waiting.append(q)
                    dr.stalled = False
                continue
            p_rep[i] = pj
            pr = P[pj]
            if pr.never_fits(p_i, 1) or dr.never_fits(p_i, o_i):
                dropped[i] = never[i] = True
            elif pr.fresh_waiting() >= pr.Q:
                dropped[i] = True
            else:
                q = _PDReq(i, t, p_i, 1)
                p_req[i] = q
                pr.waiting.append(q)
                pr.stalled = False
        # 4. Scheduling; D's allocations start transfers.
        for rp in P + D:
            if rp.has_boundary():
                rp.schedule(t)
                for dq in rp.started:
                    i = dq.i
                    pr = P[p_rep[i]]
                    active += 1
                    nbytes = pr.blocks(dq.p) * pr.b * float(lk["kv_bytes_per_token"])
                    bw = float(lk["bandwidth"]) / (active if lk["shared"] else 1)
                    t_start[i] = t
                    heapq.heappush(transfers, (t + float(lk["base_latency"]) + nbytes / bw,
                                               seq, i))
                    seq += 1
                rp.started = []

    def times(attr):
        return np.array([nan if (q is None or getattr(q, attr) is None) else getattr(q, attr)
                         for q in d_req])

    return {
        "p_replica": p_rep, "d_replica": d_rep, "prefill_done": prefill_done,
        "transfer_start": t_start, "transfer_end": t_end,
        "first_token": times("first"), "finish": times("finish"),
        "preemptions": np.array([(p_req[i].pre if p_req[i] else 0)
                                 + (d_req[i].pre if d_req[i] else 0) for i in range(n)],
                                np.int64),
        "dropped": dropped, "never_fit": never,
        "prefill_iterations": np.array([rp.iterations for rp in P], np.int64),
        "decode_iterations": np.array([rp.iterations for rp in D], np.int64),
        "prefill_busy": np.array([rp.busy for rp in P]),
        "decode_busy": np.array([rp.busy for rp in D]),
        "prefill_preemptions": np.array([rp.preemptions for rp in P], np.int64),
        "decode_preemptions": np.array([rp.preemptions for rp in D], np.int64),
    }
