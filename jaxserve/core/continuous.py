"""Continuous-batching replicas with a paged KV cache: the engine of `docs/contract_continuous.md`.

Each replica runs vLLM v1's FCFS scheduler at every iteration boundary (`scheduler`). This
module is the loop that drives it and the engine's surface: `advance` (to a horizon),
`rebase`, `tokens_in_flight`, with the state, routing and prefix-cache functions envs and
policies read re-exported from the modules that hold them:

- `cpu_numerics`: arithmetic written for XLA:CPU (compensated clock, int division, sums);
- `kv_blocks`: the block pool and its free queue under prefix caching;
- `replica_state`: the replicas' state types, constructors and what is read from them;
- `prefix_cache`: prefix trees, identities, lookup and the prefix-aware schedule decisions;
- `scheduler`: routing into queues and the FCFS boundary in closed form;
- `decode_run`: runs of pure-decode iterations skipped in closed form.

Event-driven and exact: `advance` jumps from iteration boundary to iteration boundary with a
`lax.while_loop`; there is no time step. Replicas are independent between arrivals, so the
loop runs one lane per replica (`lanes.lane_while`: under `vmap` every environment's replicas
form one batch of lanes, compacted on CPU), except when a request log is kept (replay), where
the cluster is one lane. Each scheduling decision is computed in closed form with prefix sums
over the running slots (`scheduler.schedule`), so a boundary costs O(max_seqs log max_seqs)
vector work (the prefix sums' shifted adds) and no inner loop.

Clock: stored times are relative to the current decision instant (time 0); `rebase` moves the
origin forward, so float32 times stay as precise as the spans between nearby events. Within one
decision window a replica may run thousands of iterations; its clock is the unevaluated float32
pair `t_end + t_lo` (compensated summation: `cpu_numerics.add_time`), so it does not drift by
an ulp per iteration the way a plain float32 running sum does.

Event order at equal timestamps (MODEL.md): iteration ends at `t <= horizon` are processed;
the next iteration is scheduled only at `t < horizon`, so arrivals at the boundary instant are
queued before it is scheduled.

Blocks: a running request holds `ceil(C / b)` blocks (`C` its computed tokens); waiting requests
hold none. So the KV state is a function of the running slots and needs no separate accounting.
With automatic prefix caching (`Replicas.pc`, docs/prefix_caching.md) the engine instead keeps
a block pool with reference counts, identities and an LRU free queue, and schedules with
`scheduler.schedule_prefix`; without it nothing of that path is traced.

Static shapes: see `replica_state`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core import queues as Q
from jaxserve.core.cpu_numerics import add_time, cumsum, rowsum
from jaxserve.core.decode_run import decode_run
from jaxserve.core.kv_blocks import PrefixCache, empty_prefix_cache, release
from jaxserve.core.lanes import compacted_while, lane_while, one_pass
from jaxserve.core.metrics import StepMetrics
from jaxserve.core.prefix_cache import (PREFIX_EXTRAS, PrefixTables, ancestor, block_accounting,
                                        cached_prefix_blocks, prefix_audit, prefix_extras,
                                        prefix_tables, shared_blocks)
from jaxserve.core.replica import ReplicaProfile
from jaxserve.core.replica_state import (Replicas, Running, TokenLog, empty_log, empty_replicas,
                                         in_system, kv_used, never_fits, watermark_blocks)
from jaxserve.core.scheduler import route, schedule, schedule_prefix, shift_queues
from jaxserve.core.tree import select

# The engine's surface (envs, policies and evaluation read these from here).
__all__ = [
    "advance", "rebase", "tokens_in_flight", "zero_extras", "route", "Replicas", "Running",
    "TokenLog", "empty_log", "empty_replicas", "kv_used", "in_system", "never_fits",
    "watermark_blocks", "rowsum", "PrefixCache", "empty_prefix_cache", "PrefixTables",
    "prefix_tables", "ancestor", "shared_blocks", "cached_prefix_blocks", "block_accounting",
    "prefix_audit", "prefix_extras", "PREFIX_EXTRAS",
]


def _end_iteration(rep: Replicas, end: jax.Array, slo_s, m: StepMetrics, ex: dict,
                   log: TokenLog | None):
    """Finishes the iteration of every replica where `end` (its end time `t_end` has come)."""
    run = rep.run
    s_n = run.arrival.shape[-1]
    idx = jnp.arange(s_n, dtype=jnp.int32)[None, :]
    valid = (idx < run.count[:, None]) & end[:, None]
    comp = run.comp + jnp.where(valid, run.sched, 0)
    sampled = valid & (run.sched > 0) & (comp == run.prompt + run.gen)
    first = sampled & (run.gen == 0)
    gen = run.gen + sampled.astype(jnp.int32)
    done = sampled & (gen == run.output)
    span = (rep.t_end[:, None] - run.arrival) + rep.t_lo[:, None]
    k = done.sum(-1)
    since = jnp.where(end, rep.t_end - jnp.maximum(rep.t_start, 0.0), 0.0)
    m = m.replace(
        completed=m.completed + k.sum(),
        latency_sum=m.latency_sum + rowsum(jnp.where(done, span, 0.0)).sum(),
        slo_met=m.slo_met + (done & (span <= slo_s)).sum().astype(jnp.int32),
        busy_time=m.busy_time + since.sum(),
        in_system_time=m.in_system_time + (k * jnp.maximum(rep.t_end, 0.0)).sum())
    ex = {**ex, "first_tokens": ex["first_tokens"] + first.sum().astype(jnp.int32),
          "ttft_sum": ex["ttft_sum"] + rowsum(jnp.where(first, span, 0.0)).sum()}
    if log is not None and log.ttft.shape[0] > 0:
        size = log.ttft.shape[0]
        i_first = jnp.where(first, run.req_id, size).ravel()
        i_done = jnp.where(done, run.req_id, size).ravel()
        log = log.replace(ttft=log.ttft.at[i_first].set(span.ravel(), mode="drop"),
                          e2e=log.e2e.at[i_done].set(span.ravel(), mode="drop"),
                          preemptions=log.preemptions.at[i_done].set(run.pre.ravel(),
                                                                     mode="drop"))
    # Compact: the survivors keep their admission order.
    keep = (idx < run.count[:, None]) & ~done
    dest = jnp.where(keep, cumsum(keep.astype(jnp.int32)) - 1, s_n)
    rows = jnp.arange(run.arrival.shape[0])[:, None]
    # One scatter of indices (slot j takes survivor src[j]), then gathers of every field.
    ident = jnp.broadcast_to(idx, keep.shape)
    src = ident.at[rows, dest].set(ident, mode="drop")
    upd = run.replace(comp=comp, gen=gen, sched=jnp.zeros_like(run.sched))

    def compact(x):
        return jnp.take_along_axis(x, src, -1)

    fields = {f: compact(getattr(upd, f)) for f in
              ("arrival", "prompt", "output", "estimate", "req_id", "gen", "comp", "pre", "sched")}
    new_run = Running(**fields, count=run.count - k)
    sel = lambda new, old: jnp.where(end.reshape(end.shape + (1,) * (new.ndim - 1)),  # noqa
                                     new, old)
    if rep.pc is not None:
        # Finished requests free their blocks in scheduling (slot) order (rule 6), then the
        # slots' block tables follow the compaction.
        def release_next(c):  # the next finished slot of every replica that has one
            pc, left = c
            j = jnp.argmax(left, -1).astype(jnp.int32)
            some = left.any(-1)
            pc = jax.vmap(lambda p, d, jj: jax.lax.cond(d, release, lambda p, _: p, p, jj))(
                pc, some, j)
            return pc, left & (idx != j[:, None])

        pc, _ = jax.lax.while_loop(lambda c: c[1].any(), release_next, (rep.pc, done))
        slot_fields = {f: jnp.take_along_axis(getattr(pc, f), src, -1)
                       for f in ("s_nblk", "s_ncached", "s_node", "s_nshared")}
        slot_fields["s_blocks"] = jnp.take_along_axis(pc.s_blocks, src[:, :, None], 1)
        rep = rep.replace(pc=jax.tree.map(sel, pc.replace(**slot_fields), rep.pc))
    rep = rep.replace(
        run=jax.tree.map(sel, new_run, run), in_iter=rep.in_iter & ~end,
        busy=rep.busy + since,
        kv_block_s=rep.kv_block_s + since * rep.iter_blocks.astype(jnp.float32),
        iterations=rep.iterations + end.astype(jnp.int32))
    return rep, m, ex, log


def _due(rep: Replicas, horizon):
    """(iteration ends due at t <= horizon, any event due) for the loop condition."""
    end = rep.in_iter & (rep.t_end <= horizon)
    has_work = (rep.queues.count + rep.run.count) > 0
    idle = ~rep.in_iter | end
    sched = idle & ~rep.stalled & has_work & (jnp.maximum(rep.t_end, 0.0) < horizon)
    return end, jnp.any(end | sched)


def _gate(active, new, old):
    """`advance`'s loop carry: `new` where the lane is `active`, else `old`, selecting every
    leaf but the waiting buffers (`queues`' slot arrays, `q_gen`, `q_pre`: O(queue slots)
    per replica) and the request log (O(requests)). A pass over an inactive lane (no event
    due: nothing ends, nothing is scheduled) writes the buffers only through victims pushed
    back and the log only at first tokens and finishes, none of which happen there, so their
    values are unchanged and need no select (which would copy them every pass)."""
    rep_new, rep_old = new[0], old[0]
    q_new, q_old = rep_new.queues, rep_old.queues
    buffers = dict(arrival=q_new.arrival, prompt=q_new.prompt, output=q_new.output,
                   estimate=q_new.estimate, req_id=q_new.req_id)
    strip = lambda r, q: r.replace(  # noqa: E731
        queues=q.replace(arrival=None, prompt=None, output=None, estimate=None, req_id=None),
        q_gen=None, q_pre=None)
    picked = select(active, (strip(rep_new, q_new),) + tuple(new[1:3]) + tuple(new[4:]),
                    (strip(rep_old, q_old),) + tuple(old[1:3]) + tuple(old[4:]))
    rep = picked[0]
    rep = rep.replace(queues=rep.queues.replace(**buffers), q_gen=rep_new.q_gen,
                      q_pre=rep_new.q_pre)
    return (rep,) + tuple(picked[1:3]) + (new[3],) + tuple(picked[3:])


def zero_extras() -> dict:
    """Continuous-batching counters reported next to `StepMetrics` in `info` (`boundaries`:
    the engine loop's boundary passes in the step, see `advance`)."""
    return {"first_tokens": jnp.int32(0), "ttft_sum": jnp.float32(0.0),
            "preemptions": jnp.int32(0), "never_fit": jnp.int32(0),
            "boundaries": jnp.int32(0)}


def advance(rep: Replicas, prof: ReplicaProfile, horizon: jax.Array, slo_s: jax.Array,
            log: TokenLog | None = None, decode_runs: bool = True,
            tables: "PrefixTables | None" = None, audit: bool = False, passes: str = "all"):
    """Runs every replica from time 0 to `horizon` (s) with no arrivals; `inf` drains.

    Processes iteration ends at `t <= horizon` and schedules iterations at `t < horizon`.
    Time-in-system over `[0, horizon]` is `sum over completions of t_c + N(horizon) *
    horizon` (N only falls inside the window). Does not rebase the clock.

    A boundary pass: iteration ends due, then, where a replica is free, the closed-form skip
    of a fixed pure-decode run (`decode_run`; off with `decode_runs=False`, which runs every
    iteration's boundary: same results up to float32 rounding, for tests and profiling), then
    the scheduler. Without a log (`log` None or of length 0: the environments) each replica
    runs its own passes in its own loop lane (`_replica_lanes`); with one, each trip of the
    loop is a pass over all replicas. Both give the same replicas bit for bit.
    `extra["boundaries"]` counts the cluster's passes (with lanes: the largest count among
    its replicas, the same number).

    With prefix caching (`rep.pc` present) the scheduler is `schedule_prefix` with the
    trace's prefix tree `tables` (required). A skipped decode run then also carries out its
    blocks' takes from the free queue (evicting cached blocks, rule 5) and the caching of
    the blocks its tokens fill (`run_blocks`), and ends before it would take one of the
    waiting head's unreferenced cache hits, the one thing in the run that could change the
    head's admission test (`run_head_check`). `audit` (tests) adds
    `extra["audit_failures"]`: boundary passes at which a block pool failed `prefix_audit`
    (per replica with lanes, per cluster with a log; 0 either way when the pools hold).

    `passes="one"` (a benchmark's ceiling, not a simulation: `engines.ContinuousEngine(
    mode="one_pass")`) cuts the loop to one boundary pass, gated by whether it is due
    (`lanes.one_pass`), so replicas with more events in the window fall behind; the default
    `"all"` runs every pass.

    Returns:
      (replicas, StepMetrics of the window, extra counters (`zero_extras` keys), log).
    """
    pre0 = rep.preemptions.sum()
    prefix = rep.pc is not None
    if prefix and tables is None:
        raise ValueError("tables (the trace's PrefixTables) are required with prefix caching")

    def body(carry, consts, active):
        prof, horizon, slo_s, tables = consts
        rp, m, ex, lg, end, _ = carry
        before = carry
        # The scopes name each phase's ops in profiles (`scripts/bench.py --trace`).
        with jax.named_scope("end_iteration"):
            rp, m, ex, lg = _end_iteration(rp, end, slo_s, m, ex, lg)
        has_work = (rp.queues.count + rp.run.count) > 0
        t = jnp.maximum(rp.t_end, 0.0)
        t_lo = jnp.where(rp.t_end > 0.0, rp.t_lo, 0.0)
        go = ~rp.in_iter & ~rp.stalled & has_work & (t < horizon)
        if decode_runs:
            with jax.named_scope("decode_run"):
                rp, t, t_lo, skipped, queue = decode_run(rp, prof, go, t, t_lo, horizon,
                                                          tables)
            m = m.replace(busy_time=m.busy_time + skipped.sum())
            go = go & (t < horizon)  # a run may end exactly at the horizon
        with jax.named_scope("schedule"):
            if prefix:
                rp, lg = schedule_prefix(rp, prof, tables, go, t, t_lo, lg,
                                          queue if decode_runs else None)
            else:
                rp = schedule(rp, prof, go, t, t_lo)
        ex = {**ex, "boundaries": ex["boundaries"] + 1}
        if audit:
            ex = {**ex, "audit_failures": ex["audit_failures"]
                  + (~prefix_audit(rp, prof).all()).astype(jnp.int32)}
        with jax.named_scope("due_and_gate"):
            return _gate(active, (rp, m, ex, lg, *_due(rp, horizon)), before)

    ex0 = zero_extras()
    if audit:
        ex0 = {**ex0, "audit_failures": jnp.int32(0)}
    pc0 = rep.pc
    horizon = jnp.asarray(horizon, jnp.float32)
    slo_s = jnp.asarray(slo_s, jnp.float32)
    if passes not in ("all", "one"):
        raise ValueError(f"passes must be 'all' or 'one', got {passes!r}")
    if log is None or log.ttft.shape[0] == 0:
        rep, m, ex = _replica_lanes(body, rep, prof, horizon, slo_s, tables, ex0,
                                    lane_while if passes == "all" else one_pass)
    elif passes == "one":
        carry = (rep, StepMetrics.zeros(), ex0, log, *_due(rep, horizon))
        consts = (prof, horizon, slo_s, tables)
        rep, m, ex, log, *_ = body(carry, consts, carry[-1])
    else:
        # The request log is one array for all replicas, written where requests finish, so
        # a logged run (replay) keeps the cluster in one lane: every trip is a pass over all
        # replicas. Under vmap the environments' trip counts differ (how many decode
        # iterations fit in the gap), so the loop compacts its environment lanes.
        carry = (rep, StepMetrics.zeros(), ex0, log, *_due(rep, horizon))
        rep, m, ex, log, *_ = compacted_while(lambda c, _: c[-1], body, carry,
                                              (prof, horizon, slo_s, tables), gated=True)
    finite = jnp.isfinite(horizon)
    h = jnp.where(finite, horizon, 0.0)
    part = jnp.where(rep.in_iter & finite, h - jnp.maximum(rep.t_start, 0.0), 0.0)
    rep = rep.replace(busy=rep.busy + part,
                      kv_block_s=rep.kv_block_s + part * rep.iter_blocks.astype(jnp.float32))
    m = m.replace(busy_time=m.busy_time + part.sum(),
                  in_system_time=m.in_system_time + in_system(rep) * h,
                  elapsed=jnp.where(finite, h, jnp.maximum(rep.t_end.max(), 0.0)))
    ex = {**ex, "preemptions": (rep.preemptions.sum() - pre0).astype(jnp.int32)}
    if prefix:
        ex = {**ex, **prefix_extras(pc0, rep.pc)}
    return rep, m, ex, log


def _replica_lanes(body, rep: Replicas, prof: ReplicaProfile, horizon, slo_s, tables,
                   ex0: dict, loop=lane_while):
    """`advance`'s loop with one lane per replica (`lanes.lane_while`), for runs without a
    request log: replicas are independent between arrivals, so each runs its own boundary
    passes, as a one-replica cluster, and a pass costs one replica's work, not the whole
    cluster's. Returns (replicas, metrics summed over replicas, extras: counters summed over
    replicas, `boundaries` their maximum, which is the number of whole-cluster passes the
    logged loop makes: a replica's due passes come first and stop together). `loop` is
    `lanes.lane_while`, or `lanes.one_pass` (`advance(passes="one")`)."""
    r = rep.num_replicas
    one = lambda x: x.reshape((r, 1) + x.shape[1:])  # noqa: E731 (replica r: a 1-replica cluster)
    rep_l = jax.tree.map(one, rep)
    prof_l = jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x), (r,)).reshape(r, 1), prof)
    h_l, slo_l = jnp.broadcast_to(horizon, (r,)), jnp.broadcast_to(slo_s, (r,))
    per_lane = lambda x: jnp.zeros((r,) + jnp.shape(x), jnp.asarray(x).dtype)  # noqa: E731
    m_l = jax.tree.map(per_lane, StepMetrics.zeros())
    ex_l = jax.tree.map(per_lane, ex0)
    end_l, due_l = jax.vmap(_due)(rep_l, h_l)

    def lane_body(carry, consts, active):
        (p, h, slo), tbl = consts
        return body(carry, (p, h, slo, tbl), active)

    rep_l, m_l, ex_l, *_ = loop(lambda c, _: c[-1], lane_body,
                                (rep_l, m_l, ex_l, None, end_l, due_l),
                                (prof_l, h_l, slo_l), tables)
    ex = {k: (v.max(0) if k == "boundaries" else v.sum(0)) for k, v in ex_l.items()}
    return (jax.tree.map(lambda x: x.reshape((r,) + x.shape[2:]), rep_l),
            jax.tree.map(lambda x: x.sum(0), m_l), ex)


def rebase(rep: Replicas, dt: jax.Array) -> Replicas:
    """Moves the clock origin `dt` seconds forward (every stored time minus `dt`)."""
    t_end, t_lo = add_time(rep.t_end, rep.t_lo, -jnp.asarray(dt, jnp.float32))
    return rep.replace(queues=shift_queues(rep.queues, dt),
                       run=rep.run.replace(arrival=rep.run.arrival - dt),
                       t_start=rep.t_start - dt, t_end=t_end, t_lo=t_lo)


def tokens_in_flight(rep: Replicas) -> jax.Array:
    """Estimated tokens each replica still holds: prompt plus output estimate of every waiting
    and running request, less what running requests have generated. `(R,)` float32."""
    run = rep.run
    valid = jnp.arange(rep.max_seqs)[None, :] < run.count[:, None]
    running = jnp.where(valid, run.prompt + jnp.maximum(run.estimate - run.gen, 0.0), 0.0)
    waiting = rowsum(jnp.where(Q.waiting_mask(rep.queues), rep.queues.prompt, 0.0))
    return rowsum(running) + waiting + rep.queues.estimate_sum
