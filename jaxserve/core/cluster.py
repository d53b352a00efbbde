"""The cluster: per-GPU queues and running batches, and advancing them through simulated time.

Event-driven and exact (`docs/contract_static.md`): the engine jumps from event to event (batch
completions, dispatches) with `lax.while_loop`; there is no time step. Between two arrivals
the GPUs evolve independently, so `advance_static` moves every GPU to the next arrival instant
at once: vectorised over GPUs for one environment, and lane-compacted over (environment, GPU)
pairs under `vmap` (see `advance_static`).

Clock: all stored times are relative to the current decision instant, which is time 0.
`rebase(cluster, dt)` moves the origin forward after each step, so float32 times stay as precise
as the spans between nearby events, however long the episode runs.

Event order at equal timestamps: completions, then arrivals, then dispatches. Hence
`advance_static(..., horizon)` processes completions at `t <= horizon` but dispatches only at
`t < horizon`: a dispatch due exactly at the next arrival instant waits until that arrival
has joined its queue.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.core import queues as Q
from jaxserve.core.lanes import active_order, batched_path, chunk_width
from jaxserve.core.metrics import StepMetrics
from jaxserve.core.service import batch_service_time, per_request_work
from jaxserve.core.types import GPUProfile


@struct.dataclass
class Servers:
    """The batch each GPU is running, summarised (fields `(num_gpus,)`).

    Attributes:
      free_at: when the running batch ends, or when the GPU last became idle (s, relative).
      run_start: when the running batch started (s, relative).
      run_count: requests in the running batch; 0 when idle. int32.
      run_latency_sum: summed latency of the running batch's requests (s), known at dispatch
        because a static batch's end time is.
      run_slo_met: requests of the running batch that will meet the SLO. int32.
      run_estimate: summed output estimates of the running batch (tokens), for features.
      est_end: when the running batch is *expected* to end (s, relative): its start plus the
        service time computed from output estimates instead of true lengths. What a real
        scheduler can know; features and non-oracle heuristics use it, never `free_at`.
      batches: batches dispatched so far on each GPU. int32.
    """

    free_at: jax.Array
    run_start: jax.Array
    run_count: jax.Array
    run_latency_sum: jax.Array
    run_slo_met: jax.Array
    run_estimate: jax.Array
    est_end: jax.Array
    batches: jax.Array


@struct.dataclass
class Waiting:
    """Running summaries of each GPU's waiting requests (fields `(num_gpus,)`, float32).

    Kept up to date by `route`, `dispatch` and the event loops, so that neither the engine's
    due test nor Routing-v0's shaping potential reads the queue slots on every step (under
    `vmap` that read was a gather over every queue of every environment).

    `first` and `full` are stored arrivals, in the frame of `Queues.arrival` (the relative
    arrival is the value plus `queues.offset`), and are re-anchored with the row they mirror,
    so the due test sees bit for bit the values it would read from the slots. They follow the
    GPUs' `max_batch`, which must stay the same through an episode (a parameter of it).

    Attributes:
      first: stored arrival of the request at the queue's head; meaningful where it is
        non-empty.
      full: stored arrival of the request at position `min(max_batch, capacity) - 1`, the one
        whose arrival fills a batch; meaningful where `count >= max_batch`.
      prompt_sum: summed prompt tokens of the waiting requests.
      prompt_sq_sum: summed squared prompt tokens (tokens^2).
      estimate_max: largest output estimate (tokens) to have joined the queue since it was
        last empty: an upper bound of the waiting requests' largest estimate (a maximum cannot
        be undone when its request leaves).
      The last three are set to exactly 0 whenever the queue empties, so float32 round-off
      cannot build up beyond one busy period.
    """

    first: jax.Array
    full: jax.Array
    prompt_sum: jax.Array
    prompt_sq_sum: jax.Array
    estimate_max: jax.Array


def _after_pop(w: Waiting, go, count, sum_p, sum_p2, first, full) -> Waiting:
    """`w` after each GPU where `go` popped requests with prompt sums `sum_p`, `sum_p2` (0
    where not `go`), leaving `count` waiting with head and batch-filling stored arrivals
    `first`, `full` (read from the slots; garbage where fewer wait, as documented)."""
    empty = count == 0
    return Waiting(first=jnp.where(go, first, w.first), full=jnp.where(go, full, w.full),
                   prompt_sum=jnp.where(empty, 0.0, w.prompt_sum - sum_p),
                   prompt_sq_sum=jnp.where(empty, 0.0, w.prompt_sq_sum - sum_p2),
                   estimate_max=jnp.where(empty, 0.0, w.estimate_max))


@struct.dataclass
class Cluster:
    """Queues and servers of all GPUs.

    `window` (static) is the largest batch any GPU may form: dispatch reads only that many
    slots at each queue's head.
    """

    queues: Q.Queues
    servers: Servers
    waiting: Waiting
    window: int = struct.field(pytree_node=False, default=1)

    @property
    def num_gpus(self) -> int:
        return self.servers.free_at.shape[-1]


@struct.dataclass
class RequestLog:
    """Per-request schedule, filled at dispatch (used by `replay`; length 0 in environments).

    Attributes:
      wait: start minus arrival (s); NaN until dispatched (so NaN for dropped requests).
      service: the batch's service time (s); finish = arrival + wait + service.
      batch: index of the batch on its GPU (0, 1, ...); -1 until dispatched. int32.
    """

    wait: jax.Array
    service: jax.Array
    batch: jax.Array


def empty_log(length: int) -> RequestLog:
    """A log for `length` requests, all undispatched."""
    nan = jnp.full((length,), jnp.nan, jnp.float32)
    return RequestLog(wait=nan, service=nan, batch=jnp.full((length,), -1, jnp.int32))


def empty_cluster(num_gpus: int, capacity: int, max_batch: int | None = None,
                  with_ids: bool = True) -> Cluster:
    """An idle cluster with empty queues of `capacity` slots per GPU.

    `max_batch` (static) bounds every GPU's batch size; defaults to `capacity`. `with_ids`
    keeps request ids in the queues, which a `RequestLog` needs.
    """
    zf = jnp.zeros((num_gpus,), jnp.float32)
    zi = jnp.zeros((num_gpus,), jnp.int32)
    servers = Servers(free_at=zf, run_start=zf, run_count=zi, run_latency_sum=zf,
                      run_slo_met=zi, run_estimate=zf, est_end=zf, batches=zi)
    window = capacity if max_batch is None else max(1, min(int(max_batch), capacity))
    return Cluster(queues=Q.empty_queues(num_gpus, capacity, with_ids), servers=servers,
                   waiting=Waiting(first=zf, full=zf, prompt_sum=zf, prompt_sq_sum=zf,
                                   estimate_max=zf),
                   window=window)


def batch_limit(cluster: Cluster, gpus: GPUProfile) -> jax.Array:
    """Most requests per batch on each GPU (`max_batch`, at least 1). int32.

    Not clipped to the queue buffer: with `max_batch > queue_cap` the batch can never fill,
    so only the timeout dispatches (MODEL.md), which clipping would silently change. Batches
    themselves never exceed `cluster.window` (validated against `max_batch` outside jit).
    """
    return jnp.maximum(gpus.max_batch, 1).astype(jnp.int32)


def _full_position(cluster: Cluster, gpus: GPUProfile) -> jax.Array:
    """Queue position of the request whose arrival fills a batch, per GPU. int32."""
    return jnp.minimum(batch_limit(cluster, gpus), cluster.queues.capacity) - 1


def in_system(cluster: Cluster) -> jax.Array:
    """Requests waiting or running, summed over GPUs. int32."""
    return (cluster.queues.count + cluster.servers.run_count).sum()


def route(cluster: Cluster, gpus: GPUProfile, req: Q.Request, gpu: jax.Array,
          enabled: jax.Array | bool = True):
    """Puts an arriving request in GPU `gpu`'s queue, or drops it if the queue is full.

    Where `enabled` is False the cluster is returned unchanged (every write dropped, see
    `queues.push`) and the request counts as dropped.

    Returns:
      (cluster, dropped bool scalar).
    """
    share = per_request_work(jax.tree.map(lambda x: x[gpu], gpus), req.prompt, req.estimate)
    q, w = cluster.queues, cluster.waiting
    n = q.count[gpu]
    queues, accepted = Q.push(q, gpu, req, gpus.queue_cap, share, enabled)
    # `push` re-anchors the GPU's row by its offset, accepted or not; the marks follow it.
    off = q.offset[gpu]
    first = jnp.where(accepted & (n == 0), req.arrival, w.first[gpu] + off)
    full = jnp.where(accepted & (n == _full_position(cluster, gpus)[gpu]), req.arrival,
                     w.full[gpu] + off)
    at = jnp.where(enabled, gpu, cluster.num_gpus)  # the GPU, or none (writes dropped)
    add = lambda a, v: a.at[at].add(jnp.where(accepted, v, 0.0), mode="drop")  # noqa: E731
    waiting = Waiting(first=w.first.at[at].set(first, mode="drop"),
                      full=w.full.at[at].set(full, mode="drop"),
                      prompt_sum=add(w.prompt_sum, req.prompt),
                      prompt_sq_sum=add(w.prompt_sq_sum, req.prompt * req.prompt),
                      estimate_max=w.estimate_max.at[at].max(
                          jnp.where(accepted, req.estimate, 0.0), mode="drop"))
    return cluster.replace(queues=queues, waiting=waiting), ~accepted


def _completion_terms(s: Servers, due: jax.Array):
    """What the batches ending where `due` credit, per GPU: (completed, latency, SLO met, busy).

    Busy time counts from the window's start (`max(run_start, 0)`), in seconds.
    """
    return (jnp.where(due, s.run_count, 0), jnp.where(due, s.run_latency_sum, 0.0),
            jnp.where(due, s.run_slo_met, 0),
            jnp.where(due, s.free_at - jnp.maximum(s.run_start, 0.0), 0.0))


def _clear_completed(s: Servers, due: jax.Array) -> Servers:
    return s.replace(run_count=jnp.where(due, 0, s.run_count),
                     run_estimate=jnp.where(due, 0.0, s.run_estimate))


def complete_due(cluster: Cluster, due: jax.Array, metrics: StepMetrics):
    """Ends the running batch of every GPU where `due` (its end time `free_at` has come).

    Credits the batch's requests to `metrics`: completions, latency, SLO and busy time since
    the window's start. Time-in-system is left to the caller's event loop.
    """
    completed, latency, met, busy = _completion_terms(cluster.servers, due)
    metrics = metrics.replace(completed=metrics.completed + completed.sum(),
                              latency_sum=metrics.latency_sum + latency.sum(),
                              slo_met=metrics.slo_met + met.sum(),
                              busy_time=metrics.busy_time + busy.sum())
    return cluster.replace(servers=_clear_completed(cluster.servers, due)), metrics


_UNROLL_WINDOW = 32  # the compacted loop reduces windows up to this wide with unrolled adds


def _window_sum(x: jax.Array, unroll: bool) -> jax.Array:
    """`x.sum(-1)` over a batch window (static width), with `unroll`: as unrolled adds.

    On the compacted path XLA's CPU backend hands the fused row reductions of `(chunk, W)`
    windows to YNNPACK kernels; unrolled adds (plain elementwise fusions) measured ~8% faster
    per env-step at 4,096 envs, but ~2x slower on the dense `(E, G, W)` path and no better at
    256 envs (docs/benchmarks.md), so only the compacted loop asks for them.
    """
    return _window_reduce(x, jnp.add, jnp.sum, unroll)


def _window_max(x: jax.Array, unroll: bool) -> jax.Array:
    """`x.max(-1)` over a batch window, unrolled like `_window_sum`."""
    return _window_reduce(x, jnp.maximum, jnp.max, unroll)


def _window_reduce(x, pairwise, whole, unroll: bool) -> jax.Array:
    w = x.shape[-1]
    if not unroll or w > _UNROLL_WINDOW:
        return whole(x, axis=-1)
    return functools.reduce(pairwise, [x[..., j] for j in range(w)])


def _start_batches(s: Servers, gpus: GPUProfile, go, k, start, slo_s, valid, win,
                   unroll: bool = False):
    """Starts, where `go`, a batch of the first `k` requests of each queue window.

    Row-wise over GPUs (or lanes): `s`, `gpus`, `go`, `k`, `start` have shape `(R,)`; `valid` and
    `win`'s `arrival` (relative, s), `prompt`, `output`, `estimate` are `(R, W)` windows at the
    queues' heads; `slo_s` is a scalar or `(R,)`. Requires `k <= W` and an idle GPU where `go`.
    The batch's service time follows `service.batch_service_time`; its requests' latencies are
    known now and stored with it. `unroll` reduces the windows with unrolled elementwise ops
    (`_window_sum`).

    Returns:
      (servers, member mask `(R, W)`, service time `(R,)`, and the popped requests' summed
      work shares, output estimates, prompts and squared prompts, each `(R,)`).
    """
    member = valid & (jnp.arange(win.arrival.shape[-1])[None, :] < k[:, None])
    prompt = jnp.where(member, win.prompt, 0.0)
    sum_p = _window_sum(prompt, unroll)
    sum_p2 = _window_sum(prompt * prompt, unroll)
    max_o = _window_max(jnp.where(member, win.output, 0.0), unroll)
    est_o = jnp.where(member, win.estimate, 0.0)
    service = batch_service_time(gpus, k, sum_p, sum_p2, max_o)
    est_service = batch_service_time(gpus, k, sum_p, sum_p2, _window_max(est_o, unroll))
    finish = start + service
    latency = finish[:, None] - win.arrival
    slo = jnp.asarray(slo_s)
    slo = slo[..., None] if slo.ndim else slo
    servers = s.replace(
        free_at=jnp.where(go, finish, s.free_at),
        run_start=jnp.where(go, start, s.run_start),
        run_count=jnp.where(go, k, s.run_count),
        run_latency_sum=jnp.where(go, _window_sum(jnp.where(member, latency, 0.0), unroll),
                                  s.run_latency_sum),
        run_slo_met=jnp.where(
            go, _window_sum((member & (latency <= slo)).astype(jnp.int32), unroll),
            s.run_slo_met),
        run_estimate=jnp.where(go, _window_sum(est_o, unroll), s.run_estimate),
        est_end=jnp.where(go, start + est_service, s.est_end),
        batches=s.batches + go.astype(jnp.int32))
    shares = per_request_work(jax.tree.map(lambda x: x[:, None], gpus), win.prompt, win.estimate)
    popped = (_window_sum(jnp.where(member, shares, 0.0), unroll), _window_sum(est_o, unroll),
              sum_p, sum_p2)
    return servers, member, service, popped


def _write_log(log: RequestLog, index, member, wait, service, batch) -> RequestLog:
    """Writes each member's schedule at `index` in the log; others (and overflow) are dropped."""
    idx = jnp.where(member, index, log.wait.shape[0]).ravel()
    put = lambda a, v: a.at[idx].set(jnp.broadcast_to(v, member.shape).ravel(),  # noqa: E731
                                     mode="drop")
    return RequestLog(wait=put(log.wait, wait), service=put(log.service, service),
                      batch=put(log.batch, batch))


def dispatch(cluster: Cluster, gpus: GPUProfile, go: jax.Array, k: jax.Array, start: jax.Array,
             slo_s: jax.Array, log: RequestLog | None = None):
    """Starts a batch of the first `k[g]` waiting requests at time `start[g]` where `go[g]`.

    Requires `1 <= k <= count` and an idle GPU where `go`. See `_start_batches`.

    Returns:
      (cluster, log).
    """
    q, s = cluster.queues, cluster.servers
    k = jnp.where(go, jnp.minimum(k, cluster.window), 0)
    valid, win = Q.front(q, cluster.window)
    servers, member, service, (work, est, sum_p, sum_p2) = _start_batches(
        s, gpus, go, k, start, slo_s, valid, win)
    if log is not None and log.wait.shape[0] > 0:
        if win.req_id is None:
            raise ValueError("a RequestLog needs a cluster built with with_ids=True")
        log = _write_log(log, win.req_id, member, start[:, None] - win.arrival,
                         service[:, None], s.batches[:, None])
    q = Q.pop_front(q, k, work, est)
    waiting = _after_pop(cluster.waiting, go, q.count, sum_p, sum_p2,
                         Q.stored_arrival_at(q, jnp.zeros_like(k)),
                         Q.stored_arrival_at(q, _full_position(cluster, gpus)))
    return cluster.replace(queues=q, servers=servers, waiting=waiting), log


def _trigger_time(free_at, count, head_arrival, last_arrival, b, timeout):
    """`max(idle from, min(arrival of the b-th waiting request, head arrival + timeout), 0)`."""
    full = jnp.where(count >= b, last_arrival, jnp.inf)
    trigger = jnp.minimum(full, head_arrival + timeout)
    return jnp.maximum(jnp.maximum(free_at, trigger), 0.0)


def static_dispatch_time(cluster: Cluster, gpus: GPUProfile) -> jax.Array:
    """When each GPU's static batcher would next dispatch, were no request to arrive (s).

    `max(idle from, min(arrival of the B-th waiting request, head arrival + timeout))`, and
    never before the current instant 0. Meaningful where the GPU is idle and its queue non-empty.
    Reads the arrivals from `cluster.waiting`, not the queue slots.
    """
    q, w = cluster.queues, cluster.waiting
    return _trigger_time(cluster.servers.free_at, q.count, w.first + q.offset,
                         w.full + q.offset, batch_limit(cluster, gpus), gpus.timeout)


def _row_due(s: Servers, count, start, horizon):
    """(completion due, dispatch due) of each GPU before `horizon`, given its dispatch time.

    A completing batch's `free_at` is its end, so `start` (from `_trigger_time`) is already
    after it; and completing a batch changes neither the start nor the dispatch flag, so both
    hold after the completion too.
    """
    completion = (s.run_count > 0) & (s.free_at <= horizon)
    idle_after = (s.run_count == 0) | completion
    return completion, idle_after & (count > 0) & (start < horizon)


def _due(cluster: Cluster, gpus: GPUProfile, horizon):
    start = static_dispatch_time(cluster, gpus)
    return (*_row_due(cluster.servers, cluster.queues.count, start, horizon), start)


def _close_window(cluster: Cluster, metrics: StepMetrics, horizon) -> StepMetrics:
    """Adds the window's open intervals: busy time of running batches, time-in-system of what
    is still in the system, and the window's length (a drain lasts to its last completion)."""
    finite = jnp.isfinite(horizon)
    h = jnp.where(finite, horizon, 0.0)
    s = cluster.servers
    running = s.run_count > 0
    return metrics.replace(
        busy_time=metrics.busy_time
        + jnp.where(running & finite, h - jnp.maximum(s.run_start, 0.0), 0.0).sum(),
        in_system_time=metrics.in_system_time + in_system(cluster) * h,
        elapsed=jnp.where(finite, h, jnp.maximum(s.free_at.max(), 0.0)))


def advance_static(cluster: Cluster, gpus: GPUProfile, horizon: jax.Array, slo_s: jax.Array,
                   log: RequestLog | None = None):
    """Runs every GPU's static batcher from time 0 up to `horizon` (s), with no arrivals.

    Processes completions at `t <= horizon` and dispatches at `t < horizon`. `horizon = inf`
    drains the system. Does not rebase the clock.

    Time-in-system over the window `[0, horizon]` uses
    `integral N(t) dt = sum over completions of k * t_c + N(horizon) * horizon`, which holds
    because `N` only falls inside the window (arrivals happen at its edges).

    One environment runs a `lax.while_loop` over all its GPUs at once. Under `vmap` the loop
    is lane-compacted (`custom_vmap`): every (environment, GPU) pair is a lane, and each round
    processes only the lanes with an event due, so the batch pays for the events that happen
    rather than for its busiest environment's count times every GPU. On GPU/TPU the batched
    loop is instead the dense one (`DENSE_UNROLL` unconditional masked iterations, then a
    fallback `while_loop`); `batched_path` picks per backend and can be overridden. All give
    the same counts exactly and the same times up to float32 rounding (the compacted path sums
    metrics in another order; the dense one is bit for bit the single-environment loop).

    Returns:
      (cluster, metrics for the window, log).
    """
    return _advance(cluster, gpus, jnp.asarray(horizon, jnp.float32),
                    jnp.asarray(slo_s, jnp.float32), log)


def _loop_body(gpus: GPUProfile, horizon, slo_s):
    """One event-loop iteration of one environment: every due completion, then every due
    dispatch, then the next due flags. A no-op (bit for bit) where nothing is due, which the
    dense masked path relies on."""

    def body(carry):
        cl, m, lg, completion, dispatch_due, start = carry
        done = jnp.where(completion, cl.servers.run_count * jnp.maximum(cl.servers.free_at, 0.0),
                         0.0)
        m = m.replace(in_system_time=m.in_system_time + done.sum())
        cl, m = complete_due(cl, completion, m)
        k = jnp.minimum(cl.queues.count, batch_limit(cl, gpus))
        cl, lg = dispatch(cl, gpus, dispatch_due, k, start, slo_s, lg)
        return (cl, m, lg, *_due(cl, gpus, horizon))

    return body


def _any_due(carry) -> jax.Array:
    # The due flags ride in the carry so each iteration evaluates them once, not in cond too.
    return jnp.any(carry[3] | carry[4])


def _advance_dense(cluster: Cluster, gpus: GPUProfile, horizon, slo_s, log):
    """`advance_static` for one environment: each iteration handles every due GPU."""
    carry = (cluster, StepMetrics.zeros(), log, *_due(cluster, gpus, horizon))
    cluster, metrics, log, *_ = jax.lax.while_loop(_any_due, _loop_body(gpus, horizon, slo_s),
                                                   carry)
    return cluster, _close_window(cluster, metrics, horizon), log


DENSE_UNROLL = 2  # unconditional iterations of the dense path: enough for most steps


def _advance_unrolled(cluster: Cluster, gpus: GPUProfile, horizon, slo_s, log):
    """`advance_static` for one environment, shaped for `vmap` on an accelerator.

    `DENSE_UNROLL` loop iterations run unconditionally (an iteration with nothing due changes
    nothing), then a `while_loop` finishes what remains. Under `vmap` the unrolled iterations
    are plain masked array work over every (environment, GPU), with no host round trip to test
    a loop condition; the fallback loop runs only in steps where some environment has more
    events than that (its condition is one reduction over the batch). Same results as
    `_advance_dense`, bit for bit.
    """
    body = _loop_body(gpus, horizon, slo_s)
    carry = (cluster, StepMetrics.zeros(), log, *_due(cluster, gpus, horizon))
    for _ in range(DENSE_UNROLL):
        carry = body(carry)
    cluster, metrics, log, *_ = jax.lax.while_loop(_any_due, body, carry)
    return cluster, _close_window(cluster, metrics, horizon), log


# ------------------------------------------- the batched path, per backend (`lanes.batched_path`)

_advance = jax.custom_batching.custom_vmap(_advance_dense)


@_advance.def_vmap
def _advance_vmap(axis_size, in_batched, cluster, gpus, horizon, slo_s, log):
    args = (cluster, gpus, horizon, slo_s, log)
    args = jax.tree.map(
        lambda x, b: x if b else jnp.broadcast_to(x, (axis_size,) + jnp.shape(x)),
        args, tuple(in_batched))
    out = _advance_batch(*args)
    return out, jax.tree.map(lambda _: True, out)


def _advance_batch_plain(cluster: Cluster, gpus: GPUProfile, horizon, slo_s, log):
    """`advance_static` for a batch of environments (the leading axis of every argument), on
    the backend's batched path (`lanes.batched_path`)."""
    path = batched_path()
    if path == "dense":
        return jax.vmap(_advance_unrolled)(cluster, gpus, horizon, slo_s, log)
    if path == "loop":
        return jax.vmap(_advance_dense)(cluster, gpus, horizon, slo_s, log)
    return _advance_lanes(cluster, gpus, horizon, slo_s, log)


# Under an enclosing `vmap` (PPO's seeds around the environments) its axis merges with the
# environments' and the batch runs as one: otherwise the outer vmap would batch the inner
# batch's compacted loop as a plain masked one.
_advance_batch = jax.custom_batching.custom_vmap(_advance_batch_plain)


@_advance_batch.def_vmap
def _advance_batch_vmap(axis_size, in_batched, *args):
    lead, lead_b = jax.tree.leaves(args[0])[0], jax.tree.leaves(in_batched[0])[0]
    envs = lead.shape[1] if lead_b else lead.shape[0]

    def merge(x, b):  # (S, B, ...) or (B, ...) -> (S * B, ...)
        x = x if b else jnp.broadcast_to(x, (axis_size,) + jnp.shape(x))
        return x.reshape((axis_size * envs,) + x.shape[2:])

    out = _advance_batch(*jax.tree.map(merge, args, tuple(in_batched)))
    out = jax.tree.map(lambda x: x.reshape((axis_size, envs) + x.shape[1:]), out)
    return out, jax.tree.map(lambda _: True, out)


def _advance_lanes(cluster: Cluster, gpus: GPUProfile, horizon, slo_s, log):
    """`advance_static` for a batch of environments (leading axis), lane by lane.

    A lane is one GPU of one environment. Lanes evolve independently within the window, and a
    lane with no event due at its start has none later (there are no arrivals inside it), so
    the lanes with events are listed once (`lanes.active_order`) and processed in chunks of
    `lanes.chunk_width` lanes: each chunk is gathered, run through the event loop in that compact
    form (completions, dispatches with flat 1-D reads of the queue windows) and scattered back;
    metrics are added to their environment's row. The all-lane due test reads only per-GPU
    scalars (`Cluster.waiting` holds the arrivals it needs), and queue slots are only read, by
    the lanes that dispatch: dispatch moves heads.
    """
    q, srv = cluster.queues, cluster.servers
    num_envs, num_gpus = srv.free_at.shape
    cap, width, n = q.capacity, cluster.window, num_envs * num_gpus
    lanes = lambda x: x.reshape((n,) + x.shape[2:])  # noqa: E731
    srv, wait = jax.tree.map(lanes, srv), jax.tree.map(lanes, cluster.waiting)
    gp = jax.tree.map(lanes, gpus)
    offset = lanes(q.offset)
    slots = {f: getattr(q, f).reshape(n * cap) for f in ("arrival", "prompt", "output",
                                                          "estimate")}
    keep_log = log is not None and log.wait.shape[-1] > 0
    if keep_log:
        if q.req_id is None:
            raise ValueError("a RequestLog needs a cluster built with with_ids=True")
        slots["req_id"] = q.req_id.reshape(n * cap)
        log_len = log.wait.shape[-1]
    horizon = jnp.repeat(horizon, num_gpus)
    slo_s = jnp.repeat(slo_s, num_gpus)
    limit = jnp.maximum(gp.max_batch, 1).astype(jnp.int32)
    full_pos = jnp.minimum(limit, cap) - 1

    def read(name, lane, pos):
        return slots[name][lane * cap + pos % cap]

    def due(s, count, w, off, b, timeout, h):
        start = _trigger_time(s.free_at, count, w.first + off, w.full + off, b, timeout)
        return (*_row_due(s, count, start, h), start)

    def run_chunk(j, carry):
        srv_all, wait_all, head_all, count_all, work_all, est_all, lg, metrics = carry
        idx = jax.lax.dynamic_slice(order, (j * chunk,), (chunk,))
        ok = idx < n
        lane = jnp.minimum(idx, n - 1)
        lane2 = lane[:, None]
        env_of = lane // num_gpus
        g = jax.tree.map(lambda x: x[lane], gp)
        b, off, h, fpos = limit[lane], offset[lane], horizon[lane], full_pos[lane]
        arange = jnp.arange(width)[None, :]

        def body(c):
            s, w, head, count, work_q, est_q, lg, comp, disp, start, acc = c
            done_n, latency, met, busy = _completion_terms(s, comp)
            in_sys = jnp.where(comp, s.run_count * jnp.maximum(s.free_at, 0.0), 0.0)
            acc = (acc[0] + done_n, acc[1] + latency, acc[2] + met, acc[3] + busy,
                   acc[4] + in_sys)
            s = _clear_completed(s, comp)

            def dispatch_due(d):
                s, w, head, count, work_q, est_q, lg = d
                k = jnp.where(disp, jnp.minimum(jnp.minimum(count, b), width), 0)
                pos = head[:, None] + arange
                win = Q.Request(arrival=read("arrival", lane2, pos) + off[:, None],
                                prompt=read("prompt", lane2, pos),
                                output=read("output", lane2, pos),
                                estimate=read("estimate", lane2, pos), size_class=None,
                                req_id=read("req_id", lane2, pos) if keep_log else None)
                batch_ids = s.batches
                s, member, service, (work, est, sum_p, sum_p2) = _start_batches(
                    s, g, disp, k, start, slo_s[lane], arange < count[:, None], win,
                    unroll=True)
                if keep_log:
                    lg = _write_log(lg, env_of[:, None] * log_len + win.req_id,
                                    member & (win.req_id < log_len),
                                    start[:, None] - win.arrival, service[:, None],
                                    batch_ids[:, None])
                head, count, work_q, est_q = Q.pop_heads(head, count, work_q, est_q, k, work,
                                                         est, cap)
                w = _after_pop(w, disp, count, sum_p, sum_p2, read("arrival", lane, head),
                               read("arrival", lane, head + fpos))
                return s, w, head, count, work_q, est_q, lg

            # An iteration in which no lane of the chunk dispatches (only completions) skips
            # the queue-window reads, the chunk's costliest part (docs/benchmarks.md).
            s, w, head, count, work_q, est_q, lg = jax.lax.cond(
                jnp.any(disp), dispatch_due, lambda d: d, (s, w, head, count, work_q, est_q, lg))
            comp, disp, start = due(s, count, w, off, b, g.timeout, h)
            return s, w, head, count, work_q, est_q, lg, comp & ok, disp & ok, start, acc

        zeros = jnp.zeros((chunk,), jnp.float32)
        izeros = jnp.zeros((chunk,), jnp.int32)
        at = lambda x: x[lane]  # noqa: E731
        c = (jax.tree.map(at, srv_all), jax.tree.map(at, wait_all), head_all[lane],
             count_all[lane], work_all[lane], est_all[lane], lg, comp0[lane] & ok,
             disp0[lane] & ok, start0[lane], (izeros, zeros, izeros, zeros, zeros))
        s, w, head, count, work_q, est_q, lg, _, _, _, acc = jax.lax.while_loop(
            lambda c: jnp.any(c[7] | c[8]), body, c)
        put = lambda a, v: a.at[idx].set(v, mode="drop")  # noqa: E731
        env = jnp.where(ok, env_of, num_envs)
        add = lambda a, v: a.at[env].add(v, mode="drop")  # noqa: E731
        metrics = metrics.replace(
            completed=add(metrics.completed, acc[0]),
            latency_sum=add(metrics.latency_sum, acc[1]), slo_met=add(metrics.slo_met, acc[2]),
            busy_time=add(metrics.busy_time, acc[3]),
            in_system_time=add(metrics.in_system_time, acc[4]))
        return (jax.tree.map(put, srv_all, s), jax.tree.map(put, wait_all, w),
                put(head_all, head), put(count_all, count), put(work_all, work_q),
                put(est_all, est_q), lg, metrics)

    head, count = lanes(q.head), lanes(q.count)
    comp0, disp0, start0 = due(srv, count, wait, offset, limit, gp.timeout, horizon)
    chunk = chunk_width(n)
    # Padded by a chunk of fill values so the last chunk's slice is never clamped backwards.
    order, num_active = active_order((comp0 | disp0).reshape(num_envs, num_gpus), n + chunk)
    num_chunks = (num_active + chunk - 1) // chunk
    flat_log = jax.tree.map(lambda x: x.reshape(-1), log) if keep_log else None
    metrics = jax.tree.map(lambda x: jnp.zeros((num_envs,), x.dtype), StepMetrics.zeros())
    carry = (srv, wait, head, count, lanes(q.work), lanes(q.estimate_sum), flat_log, metrics)
    srv, wait, head, count, work, est, flat_log, metrics = jax.lax.fori_loop(
        0, num_chunks, run_chunk, carry)
    back = lambda x: x.reshape((num_envs, num_gpus) + x.shape[1:])  # noqa: E731
    cluster = cluster.replace(
        servers=jax.tree.map(back, srv), waiting=jax.tree.map(back, wait),
        queues=q.replace(head=back(head), count=back(count), work=back(work),
                         estimate_sum=back(est)))
    if keep_log:
        log = jax.tree.map(lambda x: x.reshape(num_envs, log_len), flat_log)
    metrics = jax.vmap(_close_window)(cluster, metrics, horizon[::num_gpus])
    return cluster, metrics, log


def rebase(cluster: Cluster, dt: jax.Array) -> Cluster:
    """Moves the clock origin `dt` seconds forward (every stored time minus `dt`).

    The queues' arrivals move lazily (`queues.shift`): only their offsets and one GPU's row.
    """
    s = cluster.servers
    return cluster.replace(
        queues=Q.shift(cluster.queues, dt),
        servers=s.replace(free_at=s.free_at - dt, run_start=s.run_start - dt,
                          est_end=s.est_end - dt))


def queued_work(cluster: Cluster, gpus: GPUProfile) -> jax.Array:
    """Expected seconds each GPU needs to finish what it holds, from the current instant.

    Expected remaining time of the running batch (`est_end`, from output estimates) plus the
    waiting requests' shares of full-batch service time (`service.per_request_work`, using
    output *estimates*, never true lengths), kept as a running total by the queues.
    `(num_gpus,)`. A batch that outlives its estimate counts 0 remaining.
    """
    s = cluster.servers
    remaining = jnp.where(s.run_count > 0, jnp.maximum(s.est_end, 0.0), 0.0)
    return remaining + jnp.maximum(cluster.queues.work, 0.0)
