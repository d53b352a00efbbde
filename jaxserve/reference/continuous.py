"""Event-by-event reference of the continuous-batching model in `docs/contract_continuous.md`.

Plain Python, float64, written from the contract's text (not from the JAX engine):

* A replica holds a FIFO `waiting` deque and a `running` list in admission order. A running
  request holds `ceil(C / b)` blocks; `free = M - sum of held blocks`.
* At each iteration boundary (vLLM v1 FCFS):
  1. running pass with budget `k = K`: for each running `r` while `k > 0`,
     `n = min(L - C, k)`; while the free blocks are short of the extra blocks
     `ceil((C + n) / b) - ceil(C / b)`, preempt the last running request (free its blocks,
     `C = 0`, keep its `g`, put it at the front of `waiting`); if the victim is `r`, the pass
     ends; otherwise `r` is scheduled and `k -= n`.
  2. admission, only if nothing was preempted: while `|running| < S`, `k > 0` and `waiting`
     is non-empty: head `h`, `n = L_h`, capped at `k` with chunked prefill; without it a head
     with `L_h > k` waits. Stop if `free - ceil(n / b) < floor(w M)`. Else admit and schedule.
  3. nothing scheduled: idle until the next arrival routed to the replica; but a boundary
     that preempted and scheduled nothing is followed by another at the same instant (which
     cannot happen here: a lone running request always fits the free blocks).
  4. the iteration lasts `T = c0 + alpha sum n + alpha2 sum_{prefill} n (C + n) + beta [any
     decode] + gamma #decode + delta sum_{decode} L` (decode: `g >= 1` and `C = L - 1` when
     scheduled). At its end `C += n`; where `C = L` a token is sampled (`g += 1`); the first
     sample sets the first-token time; `g = o` completes the request.
* Arrivals: dropped when the replica holds `Q` waiting requests that were never preempted, or
  when `ceil((p + o) / b) > M - floor(w M)`, or without chunked prefill `p + o > K`.
* Event order at one instant: iteration ends, then arrivals (index order), then scheduling of
  every idle replica that has work and is not stalled.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

REPLICA_KEYS = ("c0", "alpha", "alpha2", "beta", "gamma", "delta", "moe", "moe_tokens",
                "kv_blocks", "block_size", "max_seqs", "max_tokens", "chunked_prefill",
                "watermark", "queue_cap")


class _Req:
    __slots__ = ("i", "a", "p", "o", "g", "C", "pre", "first", "finish")

    def __init__(self, i, a, p, o):
        self.i, self.a, self.p, self.o = i, a, p, o
        self.g = 0
        self.C = 0
        self.pre = 0
        self.first = None
        self.finish = None

    @property
    def L(self):
        return self.p + self.g


def split_schedule(sched):
    """An iteration's `(request, n)` pairs as `(prefills, decodes)`: the `(n, C)` of each
    prefilling request and the `L` of each decode (`g >= 1`, `C = L - 1`), before `C` moves."""
    pf, dec = [], []
    for r, n in sched:
        if r.g >= 1 and r.C == r.L - 1:
            dec.append(r.L)
        else:
            pf.append((n, r.C))
    return pf, dec


class _Replica:
    def __init__(self, prof, step_time=None, on_iteration=None):
        self.c0, self.alpha, self.alpha2 = prof["c0"], prof["alpha"], prof["alpha2"]
        self.beta, self.gamma, self.delta = prof["beta"], prof["gamma"], prof["delta"]
        self.moe, self.moe_tokens = prof.get("moe", 0.0), prof.get("moe_tokens", 1)
        self.M, self.b = int(prof["kv_blocks"]), int(prof["block_size"])
        self.S, self.K = int(prof["max_seqs"]), int(prof["max_tokens"])
        self.chunked = bool(prof["chunked_prefill"])
        self.wm = math.floor(prof["watermark"] * self.M)
        self.Q = int(prof["queue_cap"])
        self.waiting = deque()
        self.running = []
        self.end = None  # end time of the iteration in progress
        self.scheduled = []
        self.stalled = False
        self.iterations = 0
        self.preemptions = 0
        self.busy = 0.0  # seconds spent in iterations
        self.kv_block_s = 0.0  # integral of blocks held during iterations
        self.kv_peak = 0
        self.step_time = step_time  # optional replacement of the iteration-time formula
        self.on_iteration = on_iteration  # optional observer of every iteration

    def blocks(self, tokens):
        return -(-tokens // self.b)

    def never_fits(self, p, o):
        return self.blocks(p + o) > self.M - self.wm or (not self.chunked and p + o > self.K)

    def has_work(self):
        return bool(self.waiting or self.running)

    def has_boundary(self):
        """Whether the replica has an iteration boundary to run at the current instant: not
        mid-iteration, not stalled, with work."""
        return self.end is None and not self.stalled and self.has_work()

    def fresh_waiting(self):
        return sum(1 for r in self.waiting if r.pre == 0)

    def held(self, r):
        """KV blocks running request `r` holds: those of its computed tokens."""
        return self.blocks(r.C)

    def used(self):
        """KV blocks in use: the running requests'."""
        return sum(self.held(r) for r in self.running)

    def schedule(self, t):
        """One iteration boundary at `t` (s): the running pass (each running request's next
        chunk, preempting from the back of `running` when blocks run short), then, unless it
        preempted, admission (`admit`); starts the iteration (`end`) or marks the replica
        stalled."""
        free = self.M - self.used()
        k = self.K
        sched = []
        preempted = False
        i = 0
        while i < len(self.running) and k > 0:
            r = self.running[i]
            n = min(r.L - r.C, k)
            extra = max(self.blocks(r.C + n) - self.held(r), 0)
            self_victim = False
            while free < extra:
                v = self.running.pop()
                free += self.held(v)
                self.requeue_preempted(v)
                preempted = True
                if v is r:
                    self_victim = True
                    break
            if self_victim:
                break
            sched.append((r, n))
            free -= extra
            k -= n
            i += 1
        if not preempted:
            self.admit(sched, free, k)
        if not sched:
            # A boundary that preempted and scheduled nothing (its first running request was
            # its own victim, so `running` is now empty) is followed at once by another one at
            # the same instant, whose admission runs (`has_boundary`: the simulation loop
            # revisits `t`). Only one that preempted nothing leaves the replica idle. With no
            # blocks held outside `running` (this colocated model) it cannot happen: a lone
            # running request fits all the free blocks (else it was dropped at arrival).
            self.stalled = not preempted
            return
        T = self.iteration_time(sched)
        if self.on_iteration is not None:
            self.on_iteration(self, t, sched, T)
        self.scheduled = sched
        self.end = t + T
        self.iterations += 1
        blocks = self.blocks_in_iteration({id(r): n for r, n in sched})
        self.busy += T
        self.kv_block_s += blocks * T
        self.kv_peak = max(self.kv_peak, blocks)

    def admit(self, sched, free, k):
        """Admission from the head of `waiting` (FCFS) while a running slot, token budget
        `k` and `free` blocks above the watermark allow; appends `(request, tokens)` to
        `sched`."""
        while len(self.running) < self.S and k > 0 and self.waiting:
            admitted, free, k = self.admit_head(sched, free, k)
            if not admitted:
                break

    def admit_head(self, sched, free, k):
        """Admits the head of `waiting` for its prompt (a chunk of at most `k` tokens with
        chunked prefill, else all of it or nothing): `(admitted, free, k)` after it."""
        h = self.waiting[0]
        if self.chunked:
            n = min(h.L, k)
        elif h.L > k:
            return False, free, k
        else:
            n = h.L
        if free - self.blocks(n) < self.wm:
            return False, free, k
        self.waiting.popleft()
        self.running.append(h)
        sched.append((h, n))
        return True, free - self.blocks(n), k - n

    def blocks_in_iteration(self, n_of):
        """Blocks held during the iteration: every running request's, after its new tokens
        (`n_of`: tokens scheduled per request id)."""
        return sum(self.blocks(r.C + n_of.get(id(r), 0)) for r in self.running)

    def requeue_preempted(self, v):
        """Recompute preemption of the popped victim `v`: its computed tokens are dropped and
        it goes back to the front of the waiting queue (MODEL_CONTINUOUS.md)."""
        v.C = 0
        v.pre += 1
        self.preemptions += 1
        self.waiting.appendleft(v)

    def iteration_time(self, sched):
        """Seconds of an iteration computing `n` tokens of each `(r, n)` in `sched` (C before):
        the contract's formula, or `step_time(prefills, decodes)` when the replica was given one
        (`prefills` the `(n, C)` of each prefilling request, `decodes` the `L` of each decode)."""
        if self.step_time is not None:
            return float(self.step_time(*split_schedule(sched)))
        T = self.c0
        n_dec = 0
        tokens = 0
        for r, n in sched:
            tokens += n
            T += self.alpha * n
            if r.g >= 1 and r.C == r.L - 1:
                n_dec += 1
                T += self.gamma + self.delta * r.L
            else:
                T += self.alpha2 * n * (r.C + n)
        if n_dec:
            T += self.beta
        return T + self.moe * min(tokens, self.moe_tokens)

    def finish_iteration(self, t):
        for r, n in self.scheduled:
            r.C += n
            if r.C == r.L:
                r.g += 1
                if r.first is None:
                    r.first = t
                if r.g == r.o:
                    r.finish = t
        self.running = [r for r in self.running if r.finish is None]
        self.scheduled = []
        self.end = None


def _lockstep_wave(reps, t, idle_s):
    """Starts one synchronised iteration of all replicas at `t` when none is mid-iteration and
    one has work: each rank with work schedules as alone, a rank without runs a dummy batch of
    `idle_s` s, and every rank's iteration ends with the slowest (vLLM's data-parallel MoE
    ranks: `DPEngineCoreProc.run_busy_loop` runs `execute_dummy_batch()` on an idle rank while a
    peer is busy, and each MoE layer's collectives wait for every rank; docs/fidelity_sources.md)."""
    if any(rp.end is not None for rp in reps):
        return
    for rp in reps:
        if not rp.stalled and rp.has_work():
            rp.schedule(t)
    ends = [rp.end for rp in reps if rp.end is not None]
    if not ends:
        return
    if len(ends) < len(reps):
        ends.append(t + idle_s)
    end = max(ends)
    for rp in reps:
        rp.end = end


def simulate(arrival, prompt, output, replica, profiles, check=None, make_request=None,
             make_replica=None, step_time=None, on_iteration=None, router=None,
             lockstep_idle_s=None):
    """Simulates the requests routed to `replica[i]` on replicas with the given profiles.

    Args:
      arrival, prompt, output, replica: per-request arrays (arrivals non-decreasing).
      profiles: list of dicts with `REPLICA_KEYS` (`moe`, `moe_tokens` may be left out: 0, 1).
      check: optional callback `check(t, arrived, completed, waiting, running, dropped)` called
        after every event instant (conservation tests).
      make_request, make_replica: optional factories `make_request(i, a, p, o)` and
        `make_replica(k, profile)` replacing `_Req` and `_Replica` (models extending this one,
        e.g. `jaxserve/reference/prefix.py`, pass subclasses and keep the objects they build).
      step_time: optional `step_time(prefills, decodes) -> seconds` replacing the iteration-time
        formula (`prefills`: `(n, C)` per prefilling request; `decodes`: `L` per decode), e.g.
        a step time built from measured kernel profiles.
      on_iteration: optional `on_iteration(replica, t, sched, T)` called when an iteration of
        `T` s starts at `t` with `sched` its `(request, n)` pairs (before `C` moves).
      router: optional `router(i, replicas) -> k` choosing request `i`'s replica at its arrival
        (after the iterations ending then, before earlier arrivals of the instant are
        scheduled), replacing `replica[i]`; `replicas` expose `waiting` and `running`.
      lockstep_idle_s: None (independent replicas, the contract), or the seconds of a dummy
        batch: the replicas then iterate in lockstep as a data-parallel MoE deployment does
        (every iteration starts on all ranks at once and lasts as long as the slowest; a rank
        without work runs the dummy batch; a request arriving at a rank mid-iteration waits
        for the common end). `busy` still counts each rank's own compute.

    Returns:
      dict of arrays: `first_token`, `finish` (NaN if dropped), `dropped`, `never_fit`,
      `preemptions`; and per replica `iterations`, `replica_preemptions`, `busy` (s),
      `kv_block_s` (blocks held during iterations, integrated over time) and `kv_peak`.
    """
    n = len(arrival)
    make_request = make_request or _Req
    reqs = [make_request(i, float(arrival[i]), int(prompt[i]), int(output[i])) for i in range(n)]
    reps = [(make_replica(k, p) if make_replica else _Replica(p, step_time, on_iteration))
            for k, p in enumerate(profiles)]
    dropped = np.zeros(n, bool)
    never = np.zeros(n, bool)
    nxt = 0
    arrived = 0
    while True:
        ends = [r.end for r in reps if r.end is not None]
        t_arr = reqs[nxt].a if nxt < n else math.inf
        if any(rp.has_boundary() for rp in reps):
            ends.append(t)  # a boundary that preempted and scheduled nothing: again at `t`
        t = min(ends + [t_arr])
        if t == math.inf:
            break
        for rp in reps:
            if rp.end is not None and rp.end == t:
                rp.finish_iteration(t)
        while nxt < n and reqs[nxt].a == t:
            q = reqs[nxt]
            rp = reps[int(router(nxt, reps) if router is not None else replica[nxt])]
            arrived += 1
            if rp.never_fits(q.p, q.o):
                dropped[nxt] = never[nxt] = True
            elif rp.fresh_waiting() >= rp.Q:
                dropped[nxt] = True
            else:
                rp.waiting.append(q)
                rp.stalled = False
            nxt += 1
        if lockstep_idle_s is not None:
            _lockstep_wave(reps, t, float(lockstep_idle_s))
        else:
            for rp in reps:
                if rp.has_boundary():
                    rp.schedule(t)
        if check is not None:
            check(t, arrived, sum(r.finish is not None for r in reqs),
                  sum(len(rp.waiting) for rp in reps), sum(len(rp.running) for rp in reps),
                  int(dropped.sum()))
    nan = float("nan")
    return {
        "first_token": np.array([nan if r.first is None else r.first for r in reqs]),
        "finish": np.array([nan if r.finish is None else r.finish for r in reqs]),
        "dropped": dropped, "never_fit": never,
        "preemptions": np.array([r.pre for r in reqs], np.int64),
        "iterations": np.array([rp.iterations for rp in reps]),
        "replica_preemptions": np.array([rp.preemptions for rp in reps]),
        "busy": np.array([rp.busy for rp in reps]),
        "kv_block_s": np.array([rp.kv_block_s for rp in reps]),
        "kv_peak": np.array([rp.kv_peak for rp in reps]),
    }
