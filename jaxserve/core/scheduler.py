"""vLLM v1's FCFS scheduler at an iteration boundary (docs/contract_continuous.md), computed in
closed form for all replicas at once.

`route` puts a request into a replica's waiting queue (or drops it). `schedule` runs one
boundary: the running pass in admission order under the token budget, recompute preemption of
the *last* running request when KV blocks run short (the victim goes back to the *front* of the
waiting queue with its computed tokens dropped), then, only if nothing was preempted, FCFS
admission under `max_seqs`, the token budget (chunked prefill or not) and the watermark. Each
decision is a prefix sum over the running slots, so a boundary costs O(max_seqs log max_seqs)
vector work and no inner loop; `apply_schedule` carries it out and starts the iteration.
`schedule_prefix` is the same boundary with prefix caching (`prefix_cache.prefix_decide`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core import queues as Q
from jaxserve.core.cpu_numerics import add_time, cdiv, cumsum, rowsum
from jaxserve.core.lanes import batch_max
from jaxserve.core.prefix_cache import PrefixTables, prefix_decide, shared_blocks
from jaxserve.core.replica import ReplicaProfile, iteration_time
from jaxserve.core.replica_state import Replicas, Running, TokenLog, never_fits, watermark_blocks


def route(rep: Replicas, prof: ReplicaProfile, req: Q.Request, replica: jax.Array,
          enabled: jax.Array | bool = True, node: jax.Array | None = None,
          tables: "PrefixTables | None" = None):
    """Queues an arriving request at `replica`, or drops it.

    Dropped when the replica's queue already holds `queue_cap` fresh waiting requests, or when
    the request could never fit (`never_fits`). An arrival wakes a stalled replica. Where
    `enabled` is False nothing changes (see `queues.push`) and the request counts as dropped.
    With prefix caching (`rep.pc`), the request's prefix identity is its deepest node `node`
    of the trace's prefix tree `tables` (-1 or None: no shared block); the queue slot keeps
    the node and the number of shared full KV blocks (`shared_blocks`).

    Returns:
      (replicas, dropped, never_fit): bool scalars; `never_fit` implies `dropped`.
    """
    p1 = jax.tree.map(lambda x: x[replica], prof)
    never = never_fits(p1, req.prompt, req.output)
    q = rep.queues
    slot = (q.head[replica] + q.count[replica]) % q.capacity
    limit = jnp.where(never, 0, prof.queue_cap + rep.q_preempted)
    queues, accepted = Q.push(q, replica, req, limit, jnp.float32(0.0), enabled)
    put = lambda a: a.at[replica, slot].set(jnp.where(accepted, 0, a[replica, slot]))  # noqa
    rep = rep.replace(queues=queues, q_gen=put(rep.q_gen), q_pre=put(rep.q_pre),
                      stalled=rep.stalled.at[replica].set(rep.stalled[replica] & ~accepted))
    if rep.pc is not None:
        node = jnp.int32(-1) if node is None else jnp.asarray(node, jnp.int32)
        nsh = (jnp.int32(0) if tables is None
               else shared_blocks(tables, node, req.prompt, p1.block_size))
        pc = rep.pc
        at = lambda a, v: a.at[replica, slot].set(  # noqa: E731
            jnp.where(accepted, v, a[replica, slot]))
        rep = rep.replace(pc=pc.replace(q_node=at(pc.q_node, node),
                                        q_nshared=at(pc.q_nshared, nsh)))
    return rep, ~accepted, never


def front_fill(arr: jax.Array, start: jax.Array, k: jax.Array, vals: jax.Array) -> jax.Array:
    """Ring buffer `arr` `(R, W)` with `vals[:, j]` written at slot `(start + j) mod W` for
    `j < k[r]`: one trip per victim, each a scatter of one value per replica, for as many
    trips as the batch's largest `k` (`lanes.batch_max`). Victims are few (mostly one); the
    rewrite of every slot of every replica's buffer (by gathers) this replaces was ~5% of
    LLMRouting-v0's traced steady-state step (lab/history/benchmarks.md, "Where the steady
    state's time went first" in the section of 2026-12-06 (morning), commits 1681f58-9b2cfc1)."""
    w = arr.shape[-1]
    rows = jnp.arange(arr.shape[0])

    def put(j, a):
        pos = jnp.where(j < k, (start + j) % w, w)  # w: out of bounds, dropped
        v = jax.lax.dynamic_index_in_dim(vals, j, axis=1, keepdims=False)
        return a.at[rows, pos].set(v.astype(a.dtype), mode="drop")

    return jax.lax.fori_loop(0, batch_max(k.max()).astype(jnp.int32), put, arr)


def push_front(q: Q.Queues, k: jax.Array, reqs: Q.Request) -> Q.Queues:
    """Puts `k[r]` requests back before the head of each queue (`count + k <= capacity`).

    `reqs` holds `(R, width)` arrays in queue order (`[:, 0]` becomes the new head). Arrivals
    are stored the way `queues.push` stores them (against the queue's time offset, if any).
    """
    width = reqs.arrival.shape[-1]
    head = (q.head - k) % q.capacity
    mask = jnp.arange(width)[None, :] < k[:, None]
    offset = getattr(q, "offset", None)
    arrival = reqs.arrival if offset is None else reqs.arrival - offset[:, None]
    put = lambda arr, v: front_fill(arr, head, k, v)  # noqa: E731
    return q.replace(
        arrival=put(q.arrival, arrival), prompt=put(q.prompt, reqs.prompt),
        output=put(q.output, reqs.output), estimate=put(q.estimate, reqs.estimate),
        req_id=None if q.req_id is None else put(q.req_id, reqs.req_id),
        head=head, count=q.count + k,
        estimate_sum=q.estimate_sum + rowsum(jnp.where(mask, reqs.estimate, 0.0)))


def shift_queues(q: Q.Queues, dt: jax.Array) -> Q.Queues:
    """Moves the queues' clock origin `dt` seconds forward."""
    if hasattr(Q, "shift"):
        return Q.shift(q, dt)
    return q.replace(arrival=q.arrival - dt)


def schedule(rep: Replicas, prof: ReplicaProfile, go: jax.Array, t: jax.Array,
              t_lo: jax.Array, extra_used: jax.Array | None = None) -> Replicas:
    """Runs the scheduler of every replica where `go`, starting an iteration at `t + t_lo`.

    `extra_used` `(R,)` (None: none): KV blocks held outside the running slots, which the
    boundary may not use: a disaggregation P replica's blocks held for sends
    (docs/disaggregation.md section 6). The running pass is `running_pass`; admission (only
    if nothing was preempted) is the longest prefix of the waiting queue that fits
    `max_seqs`, the budget and the watermark, again by prefix sums.
    """
    keep, n_run, k1, free1, preempted = running_pass(rep, prof, go, extra_used)
    run, q = rep.run, rep.queues
    s_n = run.arrival.shape[-1]
    idx = jnp.arange(s_n, dtype=jnp.int32)[None, :]
    b = prof.block_size[:, None]

    # Admission from the first max_seqs waiting slots.
    w_valid, win = Q.front(q, s_n)
    w_slots = (q.head[:, None] + idx) % q.capacity
    w_gen = jnp.take_along_axis(rep.q_gen, w_slots, -1)
    w_prompt = win.prompt.astype(jnp.int32)
    w_len = jnp.where(w_valid, w_prompt + w_gen, 0)
    k_j = k1[:, None] - (cumsum(w_len) - w_len)
    chunk = prof.chunked_prefill[:, None]
    w_n = jnp.where(chunk, jnp.minimum(w_len, k_j), w_len)
    w_blocks = cdiv(w_n, b)
    free_j = free1[:, None] - (cumsum(w_blocks) - w_blocks)
    ok = (w_valid & (idx < (prof.max_seqs - run.count)[:, None]) & (k_j > 0)
          & (chunk | (w_len <= k_j))
          & (free_j - w_blocks >= watermark_blocks(prof)[:, None])
          & ~preempted[:, None] & go[:, None])
    first_fail = jnp.where(ok, s_n, idx).min(-1)
    admit = idx < first_fail[:, None]
    with jax.named_scope("apply"):
        return apply_schedule(rep, prof, go, t, t_lo, n_run, keep, admit, w_n,
                              extra_blocks=extra_used)


def running_pass(rep: Replicas, prof: ReplicaProfile, go: jax.Array,
                 extra_used: jax.Array | None = None):
    """The running pass of every replica where `go` (vLLM's first loop at a boundary).

    `extra_used` `(R,)` (None: none) are KV blocks held outside the running slots (blocks a
    disaggregation P replica holds for sends, a D replica's reservations for receives):
    they are not free, and never preempted.

    Returns `(keep, n_run, k1, free1, preempted)`: running requests left, tokens scheduled
    per running slot `(R, S)`, token budget left, free blocks left (valid where nothing was
    preempted) and whether the pass preempted. All `(R,)` int32 but `n_run` and the bool.

    Closed form. Let `n_i = clip(K - sum_{j<i} (L_j - C_j), 0, L_i - C_i)`
    (the budget taken in admission order), `need_i` the extra blocks `n_i` tokens take, `D_i`
    their prefix sum, `F` the free blocks and `H(e)` the blocks held by running slots `>= e`.
    Preempting the last requests until the free blocks cover `D_i` leaves the running prefix
    `E_i = max{e : H(e) >= D_i - F}`; `E` only falls as `i` grows, so request `i` is scheduled
    iff `n_i > 0` and `E_i > i` (a prefix of `s` requests), and the pass leaves `E_{s-1}`
    requests running, or `s` when it stopped because request `s` was itself the victim.
    """
    run = rep.run
    r_n, s_n = run.arrival.shape
    idx = jnp.arange(s_n, dtype=jnp.int32)[None, :]
    valid = idx < run.count[:, None]
    b = prof.block_size[:, None]
    big_k = prof.max_tokens[:, None]
    length = run.prompt + run.gen
    rem = jnp.where(valid, length - run.comp, 0)
    n = jnp.clip(big_k - (cumsum(rem) - rem), 0, rem)
    held = jnp.where(valid, cdiv(run.comp, b), 0)
    need = jnp.where(n > 0, cdiv(run.comp + n, b) - held, 0)
    demand = cumsum(need)
    free0 = prof.kv_blocks - held.sum(-1)
    if extra_used is not None:
        free0 = free0 - extra_used

    def search():
        suffix = jnp.concatenate([cumsum(held[:, ::-1])[:, ::-1],
                                  jnp.zeros((r_n, 1), jnp.int32)], -1)  # (R, S+1): H(e)
        # H is non-increasing in e, so {e <= count : H(e) >= x} is a prefix [0, E] of the
        # slots: E_i > i iff i + 1 <= count and H(i + 1) >= D_i - F, one compare per slot
        # (a binary search per slot gathered ~7 times per pass).
        e_ok = jnp.arange(s_n + 1)[None, :] <= run.count[:, None]
        sched = ((n > 0) & (idx < run.count[:, None])
                 & (suffix[:, 1:] >= demand - free0[:, None]))
        s = sched.sum(-1)
        n_at_s = jnp.take_along_axis(n, jnp.minimum(s, s_n - 1)[:, None], -1)[:, 0]
        stop_self = (s < run.count) & (n_at_s > 0)
        used = jnp.where(s > 0, jnp.take_along_axis(demand, jnp.maximum(s - 1, 0)[:, None],
                                                    -1)[:, 0], 0)
        # E_{s-1}: #{e <= count : H(e) >= D_{s-1} - F} - 1.
        e_last = (e_ok & (suffix >= (used - free0)[:, None])).sum(-1).astype(jnp.int32) - 1
        e_prev = jnp.where(s > 0, e_last, run.count)
        keep = jnp.where(stop_self, s, jnp.minimum(e_prev, run.count))
        return keep, jnp.where(sched, n, 0), used

    def fits():
        # Every budgeted request's new blocks fit (D_{S-1} <= F): the search above would find
        # E_i = count for every i, so all of them run and nobody is preempted.
        return run.count, n, demand[:, -1]

    # The search (a log-depth scan per slot) runs only when some replica of the batch is
    # short of blocks (`lanes.batch_max`: one conditional under vmap).
    short = (go & (demand[:, -1] > free0)).any()
    keep, n_run, used = jax.lax.cond(batch_max(short), search, fits)
    npre = jnp.where(go, run.count - keep, 0)
    preempted = npre > 0
    k1 = prof.max_tokens - n_run.sum(-1)
    free1 = free0 - used  # valid where nothing was preempted
    return keep, n_run, k1, free1, preempted


def apply_schedule(rep: Replicas, prof: ReplicaProfile, go: jax.Array, t: jax.Array,
                    t_lo: jax.Array, n_run: jax.Array, keep: jax.Array, admit: jax.Array,
                    w_n: jax.Array, w_comp: jax.Array | None = None,
                    blocks: jax.Array | None = None, extra_blocks: jax.Array | None = None,
                    window: dict | None = None, popped: jax.Array | None = None,
                    popped_estimate: jax.Array | None = None) -> Replicas:
    """Carries out a scheduling decision where `go` and starts the iterations at `t + t_lo`.

    The decision: `n_run` `(R, S)` tokens scheduled per running slot, `keep` `(R,)` running
    requests left after preemption (slots `[keep, count)` are the victims), `admit` `(R, S)`
    the admitted prefix of the waiting queue's first `S` requests with `w_n` tokens each and
    `w_comp` tokens already computed (cache hits; 0 without prefix caching). `blocks` `(R,)`
    overrides the KV blocks held during the iteration (distinct blocks with prefix caching);
    `extra_blocks` `(R,)` are added to them (blocks held outside the running slots: sends,
    reservations). Victims go back to the queue's front, admitted requests join the running
    slots after the survivors, and the iteration time is `docs/contract_continuous.md`'s
    formula.

    By default the admitted requests are the queue's first ones. A caller whose admission
    also takes requests from elsewhere, or moves some queue entries elsewhere (a
    disaggregation D replica: `schedule_remote`), passes `window`, the admitted requests in
    running order (dict of `(R, S)` arrays `arrival`, `prompt`, `output`, `estimate`,
    `req_id`, `gen`, `pre`), with `popped` `(R,)` the entries taken off the queue's front and
    `popped_estimate` `(R,)` their summed output estimates.
    """
    run, q = rep.run, rep.queues
    r_n, s_n = run.arrival.shape
    idx = jnp.arange(s_n, dtype=jnp.int32)[None, :]
    b = prof.block_size[:, None]
    s = (n_run > 0).sum(-1)
    npre = jnp.where(go, run.count - keep, 0)
    a = admit.sum(-1).astype(jnp.int32)
    if window is None:
        w_valid, win = Q.front(q, s_n)
        w_slots = (q.head[:, None] + idx) % q.capacity
        w_gen = jnp.take_along_axis(rep.q_gen, w_slots, -1)
        w_pre = jnp.take_along_axis(rep.q_pre, w_slots, -1)
    else:
        win = Q.Request(arrival=window["arrival"], prompt=window["prompt"],
                        output=window["output"], estimate=window["estimate"],
                        size_class=None, req_id=window["req_id"])
        w_gen, w_pre = window["gen"], window["pre"]
    if w_comp is None:
        w_comp = jnp.zeros_like(w_gen)

    # Victims [keep, count) back to the front of the queue, in admission order.
    v_idx = jnp.minimum(keep[:, None] + idx, s_n - 1)
    take = lambda x: jnp.take_along_axis(x, v_idx, -1)  # noqa: E731
    victims = Q.Request(arrival=take(run.arrival), prompt=take(run.prompt),
                        output=take(run.output), estimate=take(run.estimate),
                        size_class=jnp.zeros_like(v_idx), req_id=take(run.req_id))

    def push_victims():
        new_head = (q.head - npre) % q.capacity
        return (front_fill(rep.q_gen, new_head, npre, take(run.gen)),
                front_fill(rep.q_pre, new_head, npre, take(run.pre) + 1),
                push_front(q, npre, victims))

    # Rewriting the waiting buffers costs O(queue slots) per replica: done only when some
    # replica of the batch preempted (one conditional under vmap, `lanes.batch_max`).
    q_gen, q_pre, queues = jax.lax.cond(batch_max((npre > 0).any()), push_victims,
                                        lambda: (rep.q_gen, rep.q_pre, q))
    if window is None:
        adm_est = rowsum(jnp.where(admit, win.estimate, 0.0))
        queues = Q.pop_front(queues, a, jnp.zeros((r_n,), jnp.float32), adm_est)
    else:
        queues = Q.pop_front(queues, popped, jnp.zeros((r_n,), jnp.float32), popped_estimate)

    # Admitted requests join the running slots after the survivors.
    count1 = jnp.where(go, keep, run.count)
    src = jnp.clip(idx - count1[:, None], 0, s_n - 1)
    new = (idx >= count1[:, None]) & (idx < (count1 + a)[:, None])

    def put(arr, v):
        return jnp.where(new, jnp.take_along_axis(v, src, -1).astype(arr.dtype), arr)

    new_run = Running(
        arrival=put(run.arrival, win.arrival), prompt=put(run.prompt, win.prompt),
        output=put(run.output, win.output), estimate=put(run.estimate, win.estimate),
        req_id=put(run.req_id, win.req_id if win.req_id is not None
                   else jnp.zeros_like(w_gen)),
        gen=put(run.gen, w_gen), comp=put(jnp.where(idx < count1[:, None], run.comp, 0),
                                          w_comp),
        pre=put(run.pre, w_pre), sched=put(jnp.where(go[:, None], n_run, run.sched), w_n),
        count=count1 + a)

    # Iteration time.
    r2 = new_run
    n_f = r2.sched.astype(jnp.float32)
    on = r2.sched > 0
    len2 = r2.prompt + r2.gen
    decoding = on & (r2.gen >= 1) & (r2.comp == len2 - 1)
    prefill = on & ~decoding
    comp_f = r2.comp.astype(jnp.float32)
    num_dec = decoding.sum(-1).astype(jnp.float32)
    iter_time = iteration_time(
        prof, rowsum(n_f), rowsum(jnp.where(prefill, n_f * (comp_f + n_f), 0.0)), num_dec,
        rowsum(jnp.where(decoding, len2.astype(jnp.float32), 0.0)))
    if blocks is None:
        valid2 = idx < r2.count[:, None]
        blocks = jnp.where(valid2, cdiv(r2.comp + r2.sched, b), 0).sum(-1)
    if extra_blocks is not None:
        blocks = blocks + extra_blocks
    started = go & ((s + a) > 0)
    end_hi, end_lo = add_time(t, t_lo, iter_time)
    sel = lambda new, old: jnp.where(go.reshape(go.shape + (1,) * (new.ndim - 1)),  # noqa
                                     new, old)
    return rep.replace(
        queues=queues, q_gen=q_gen, q_pre=q_pre,  # no-ops where not `go` (npre = a = 0)
        q_preempted=rep.q_preempted + npre - jnp.minimum(a if popped is None else popped,
                                                         rep.q_preempted + npre),
        run=jax.tree.map(sel, new_run, run),
        in_iter=rep.in_iter | started,
        t_start=jnp.where(started, t, rep.t_start),
        t_end=jnp.where(started, end_hi, rep.t_end),
        t_lo=jnp.where(started, end_lo, rep.t_lo),
        stalled=rep.stalled | (go & ~started),
        iter_blocks=jnp.where(started, blocks, rep.iter_blocks),
        kv_peak=jnp.where(started, jnp.maximum(rep.kv_peak, blocks), rep.kv_peak),
        preemptions=rep.preemptions + npre)


def schedule_prefix(rep: Replicas, prof: ReplicaProfile, tables: PrefixTables,
                     go: jax.Array, t: jax.Array, t_lo: jax.Array,
                     log: TokenLog | None, queue=None) -> tuple[Replicas, TokenLog | None]:
    """`schedule` with prefix caching: the decision of `prefix_decide` for every replica,
    carried out by `apply_schedule`; the waiting requests' prefix ids follow them between
    queue and running slots, and the log records each admission's cached tokens. `queue`:
    every replica's free queue (`free_order`, leading axis `R`) if the caller has it."""
    pc, run, q = rep.pc, rep.run, rep.queues
    s_n = run.arrival.shape[-1]
    idx = jnp.arange(s_n, dtype=jnp.int32)[None, :]
    w_valid, win = Q.front(q, s_n)
    w_slots = (q.head[:, None] + idx) % q.capacity
    gat = lambda a: jnp.take_along_axis(a, w_slots, -1)  # noqa: E731
    w = {"valid": w_valid, "len": win.prompt.astype(jnp.int32) + gat(rep.q_gen),
         "node": gat(pc.q_node), "nshared": gat(pc.q_nshared), "req_id": win.req_id}
    pc, n_run, keep, admit, w_n, w_comp = jax.vmap(
        prefix_decide, in_axes=(0, 0, 0, 0, None, 0, 0))(pc, run, w, prof, tables, go, queue)
    held = ((pc.ref > 0) & (jnp.arange(pc.ref.shape[-1])[None, :]
                            < prof.kv_blocks[:, None])).sum(-1)
    # Victims' prefix ids go to the queue's front (as `apply_schedule` moves the requests).
    npre = jnp.where(go, run.count - keep, 0)
    new_head = (q.head - npre) % q.capacity
    v_idx = jnp.minimum(keep[:, None] + idx, s_n - 1)
    pc = pc.replace(
        q_node=front_fill(pc.q_node, new_head, npre, jnp.take_along_axis(pc.s_node, v_idx, -1)),
        q_nshared=front_fill(pc.q_nshared, new_head, npre,
                              jnp.take_along_axis(pc.s_nshared, v_idx, -1)))
    rep = apply_schedule(rep.replace(pc=pc), prof, go, t, t_lo, n_run, keep, admit, w_n,
                          w_comp, blocks=held)
    if log is not None and log.cached_first is not None and log.ttft.shape[0] > 0:
        size = log.ttft.shape[0]
        ids = jnp.where(admit, win.req_id, size).ravel()
        cur = log.cached_first[jnp.minimum(ids, size - 1)]
        log = log.replace(
            cached_first=log.cached_first.at[ids].set(
                jnp.where(cur < 0, w_comp.ravel(), cur), mode="drop"),
            cached_total=log.cached_total.at[ids].add(w_comp.ravel(), mode="drop"))
    return rep, log


def schedule_remote(rep: Replicas, prof: ReplicaProfile, go: jax.Array, t: jax.Array,
                    t_lo: jax.Array, remote: dict, q_pending: jax.Array, width: int,
                    extra_used: jax.Array | None = None):
    """`schedule` of a disaggregation replica (docs/disaggregation.md sections 6 and 8), where
    `go`. A P replica (no remote request, no pending entry, `extra_used` its blocks held for
    sends) gets `schedule`'s decision; a D replica the page's additions below.

    The running pass is `running_pass` with the blocks reserved by the remote list
    (`remote["res"]` summed) held outside the running slots; a pass that preempted and
    scheduled nothing leaves the replica not stalled (a second boundary follows at the same
    instant). Admission, only if nothing was preempted, visits the remote list first, then
    the waiting queue (vLLM's `skipped_waiting` before `waiting`):

    * remote list, in its (allocation) order: a receiving request is skipped; a ready one
      (`remote["ready"]`) is scheduled for its last prompt token (`C = p - 1`, `n = 1`,
      no new block: its `ceil(p / b)` are reserved) while `|running| < S`, the budget is
      positive and the free blocks are at or above the watermark; the first that cannot be
      stops the admission;
    * then the waiting queue's first `width` entries, FCFS: a pending D request
      (`q_pending`) is allocated `ceil(p / b)` blocks if `free - ceil(p / b) >= floor(w M)`
      (no token budget, no running slot; still only while `|running| < S` and the budget is
      positive), else the admission stops; any other entry is admitted as in `schedule`.

    In closed form: the ready requests admitted are `min(ready, S - |running|, k)` (all or
    none of the watermark test, which their zero new blocks make the same for each), and the
    waiting entries are `schedule`'s prefix sums with pending entries taking blocks but no
    budget and no slot. With no remote request and no pending entry this is `schedule`'s
    decision.

    Args:
      remote: the remote list, `(R, X)` arrays in allocation order: `valid`, `ready` (bool),
        `res` (reserved blocks), `arrival` (relative s), `prompt`, `output`, `req_id`.
      q_pending: `(R, W)` bool over the waiting ring buffer's slots: pending D requests.
      extra_used: `(R,)` blocks held outside the running slots besides the reservations
        (a P replica's sends), or None.
      width: static number of waiting entries the admission may visit (a pending entry takes
        no slot, so more than `S` may be visited); `overflow` reports a pass that reached
        the end of the window still admitting while the queue held more.

    Returns:
      `(replicas, decision)`: `decision` has `taken` `(R, X)` (ready requests moved to the
      running slots), `alloc` `(R, width)` (waiting entries allocated, in queue order),
      `win` (the waiting window: `arrival`, `prompt`, `output`, `req_id`, `need`: blocks),
      `popped` `(R,)` entries taken off the queue's front, `overflow` `(R,)` bool.
    """
    reserved = jnp.where(remote["valid"], remote["res"], 0).sum(-1)
    if extra_used is not None:
        reserved = reserved + extra_used
    keep, n_run, k1, free1, preempted = running_pass(rep, prof, go, reserved)
    run, q = rep.run, rep.queues
    s_n = run.arrival.shape[-1]
    b = prof.block_size[:, None]
    wm = watermark_blocks(prof)
    room = prof.max_seqs - run.count  # nothing was preempted where admission runs

    # Remote list: the first `a_r` ready requests, in list order.
    ready = remote["valid"] & remote["ready"]
    n_ready = ready.sum(-1).astype(jnp.int32)
    cont = go & ~preempted
    a_r = jnp.where(cont & (free1 >= wm), jnp.maximum(jnp.minimum(n_ready, jnp.minimum(room, k1)),
                                                      0), 0)
    r_rank = cumsum(ready.astype(jnp.int32)) - 1
    taken = ready & (r_rank < a_r[:, None])
    to_wait = cont & (a_r == n_ready)

    # Waiting queue: pending entries take blocks, no budget, no slot.
    w_idx = jnp.arange(width, dtype=jnp.int32)[None, :]
    w_valid, win = Q.front(q, width)
    w_slots = (q.head[:, None] + w_idx) % q.capacity
    w_gen = jnp.take_along_axis(rep.q_gen, w_slots, -1)
    w_pre = jnp.take_along_axis(rep.q_pre, w_slots, -1)
    pend = w_valid & jnp.take_along_axis(q_pending, w_slots, -1)
    w_prompt = win.prompt.astype(jnp.int32)
    w_len = jnp.where(w_valid, w_prompt + w_gen, 0)
    tok = jnp.where(pend, 0, w_len)
    k_j = (k1 - a_r)[:, None] - (cumsum(tok) - tok)
    chunk = prof.chunked_prefill[:, None]
    w_n = jnp.where(pend, 0, jnp.where(chunk, jnp.minimum(w_len, k_j), w_len))
    need = cdiv(w_prompt, b)
    w_blocks = jnp.where(pend, need, cdiv(w_n, b))
    free_j = free1[:, None] - (cumsum(w_blocks) - w_blocks)
    slot = (~pend).astype(jnp.int32)
    s_j = (run.count + a_r)[:, None] + (cumsum(slot) - slot)
    ok = (w_valid & (s_j < prof.max_seqs[:, None]) & (k_j > 0)
          & (chunk | pend | (w_len <= k_j)) & (free_j - w_blocks >= wm[:, None])
          & to_wait[:, None])
    popped = jnp.where(ok, width, w_idx).min(-1).astype(jnp.int32)
    adm = w_idx < popped[:, None]
    alloc = adm & pend
    joins = adm & ~pend
    overflow = go & (popped == width) & (q.count > width)

    # The requests joining the running slots, in running order: ready ones, then waiting ones.
    w_rank = a_r[:, None] + cumsum(joins.astype(jnp.int32)) - 1
    rows = jnp.arange(run.arrival.shape[0])[:, None]
    r_dest = jnp.where(taken, r_rank, s_n)
    w_dest = jnp.where(joins, w_rank, s_n)

    def place(r_vals, w_vals, dtype):
        # The fields of one dtype stacked on a last axis: two scatters for all of them
        # (XLA:CPU compiles each scatter as a loop of its own).
        r_val = jnp.stack([v.astype(dtype) for v in r_vals], -1)
        w_val = jnp.stack([v.astype(dtype) for v in w_vals], -1)
        out = jnp.zeros((rows.shape[0], s_n, len(r_vals)), dtype)
        out = out.at[rows, r_dest].set(r_val, mode="drop")
        return out.at[rows, w_dest].set(w_val, mode="drop")

    zr = jnp.zeros_like(remote["prompt"])
    w_ids = win.req_id if win.req_id is not None else jnp.zeros_like(w_gen)
    fl = place([remote["arrival"], remote["prompt"], remote["output"], zr],
               [win.arrival, w_prompt, win.output, win.estimate], jnp.float32)
    # A ready request recomputes its last prompt token (`n = 1` with `C = p - 1`): vLLM's
    # `_update_waiting_for_remote_kv`.
    it = place([remote["req_id"], zr, zr, jnp.ones_like(zr), remote["prompt"] - 1],
               [w_ids, w_gen, w_pre, w_n, jnp.zeros_like(w_n)], jnp.int32)
    window = {"arrival": fl[..., 0], "prompt": fl[..., 1], "output": fl[..., 2],
              "estimate": fl[..., 3], "req_id": it[..., 0], "gen": it[..., 1],
              "pre": it[..., 2]}
    n_win, comp_win = it[..., 3], it[..., 4]
    admit = jnp.arange(s_n, dtype=jnp.int32)[None, :] < (a_r + joins.sum(-1))[:, None]
    reserved_after = (reserved - jnp.where(taken, remote["res"], 0).sum(-1)
                      + jnp.where(alloc, need, 0).sum(-1))
    popped_est = rowsum(jnp.where(adm, win.estimate, 0.0))
    rep = apply_schedule(rep, prof, go, t, t_lo, n_run, keep, admit, n_win, comp_win,
                         extra_blocks=jnp.where(go, reserved_after, reserved), window=window,
                         popped=popped, popped_estimate=popped_est)
    # A boundary that preempted and scheduled nothing does not stall the replica: it has
    # another boundary at the same instant (docs/disaggregation.md section 8, step 3), where
    # its admission runs (`running` is then empty: its first request was its own victim).
    rep = rep.replace(stalled=rep.stalled & ~(go & preempted))
    decision = {"taken": taken, "alloc": alloc, "popped": popped, "overflow": overflow,
                "win": {"arrival": win.arrival, "prompt": w_prompt, "output": win.output,
                        "req_id": win.req_id, "need": need}}
    return rep, decision
