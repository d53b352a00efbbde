"""The cluster: per-GPU queues and running batches, and advancing them through simulated time.

Event-driven and exact (`shared/MODEL.md`): the engine jumps from event to event (batch
completions, dispatches) with `lax.while_loop`; there is no time step. Between two arrivals
the GPUs evolve independently, so `advance_static` moves every GPU to the next arrival instant
at once, vectorised over GPUs.

Clock: all stored times are relative to the current decision instant, which is time 0.
`rebase(cluster, dt)` moves the origin forward after each step, so float32 times stay as precise
as the spans between nearby events, however long the episode runs.

Event order at equal timestamps: completions, then arrivals, then dispatches. Hence
`advance_static(..., horizon)` processes completions at `t <= horizon` but dispatches only at
`t < horizon`: a dispatch due exactly at the next arrival instant waits until that arrival
has joined its queue.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.core import queues as Q
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
class Cluster:
    """Queues and servers of all GPUs.

    `window` (static) is the largest batch any GPU may form: dispatch reads only that many
    slots at each queue's head.
    """

    queues: Q.Queues
    servers: Servers
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
                   window=window)


def batch_limit(cluster: Cluster, gpus: GPUProfile) -> jax.Array:
    """Most requests per batch on each GPU (`max_batch`, at least 1). int32.

    Not clipped to the queue buffer: with `max_batch > queue_cap` the batch can never fill,
    so only the timeout dispatches (MODEL.md), which clipping would silently change. Batches
    themselves never exceed `cluster.window` (validated against `max_batch` outside jit).
    """
    return jnp.maximum(gpus.max_batch, 1).astype(jnp.int32)


def in_system(cluster: Cluster) -> jax.Array:
    """Requests waiting or running, summed over GPUs. int32."""
    return (cluster.queues.count + cluster.servers.run_count).sum()


def route(cluster: Cluster, gpus: GPUProfile, req: Q.Request, gpu: jax.Array):
    """Puts an arriving request in GPU `gpu`'s queue, or drops it if the queue is full.

    Returns:
      (cluster, dropped bool scalar).
    """
    share = per_request_work(jax.tree.map(lambda x: x[gpu], gpus), req.prompt, req.estimate)
    queues, accepted = Q.push(cluster.queues, gpu, req, gpus.queue_cap, share)
    return cluster.replace(queues=queues), ~accepted


def complete_due(cluster: Cluster, due: jax.Array, metrics: StepMetrics):
    """Ends the running batch of every GPU where `due` (its end time `free_at` has come).

    Credits the batch's requests to `metrics`: completions, latency, SLO and busy time since
    the window's start. Time-in-system is left to the caller's event loop.
    """
    s = cluster.servers
    k = jnp.where(due, s.run_count, 0)
    busy = jnp.where(due, s.free_at - jnp.maximum(s.run_start, 0.0), 0.0)
    metrics = metrics.replace(
        completed=metrics.completed + k.sum(),
        latency_sum=metrics.latency_sum + jnp.where(due, s.run_latency_sum, 0.0).sum(),
        slo_met=metrics.slo_met + jnp.where(due, s.run_slo_met, 0).sum(),
        busy_time=metrics.busy_time + busy.sum())
    servers = s.replace(run_count=jnp.where(due, 0, s.run_count),
                        run_estimate=jnp.where(due, 0.0, s.run_estimate))
    return cluster.replace(servers=servers), metrics


def dispatch(cluster: Cluster, gpus: GPUProfile, go: jax.Array, k: jax.Array, start: jax.Array,
             slo_s: jax.Array, log: RequestLog | None = None):
    """Starts a batch of the first `k[g]` waiting requests at time `start[g]` where `go[g]`.

    Requires `1 <= k <= count` and an idle GPU where `go`. The batch's service time follows
    `service.batch_service_time`; its requests' latencies are known now and stored with it.

    Returns:
      (cluster, log).
    """
    q, s = cluster.queues, cluster.servers
    k = jnp.where(go, jnp.minimum(k, cluster.window), 0)
    valid, win = Q.front(q, cluster.window)
    member = valid & (jnp.arange(cluster.window)[None, :] < k[:, None])
    prompt = jnp.where(member, win.prompt, 0.0)
    sum_p = prompt.sum(-1)
    sum_p2 = (prompt * prompt).sum(-1)
    max_o = jnp.where(member, win.output, 0.0).max(-1)
    service = batch_service_time(gpus, k, sum_p, sum_p2, max_o)
    est_o = jnp.where(member, win.estimate, 0.0)
    est_service = batch_service_time(gpus, k, sum_p, sum_p2, est_o.max(-1))
    finish = start + service
    latency = finish[:, None] - win.arrival
    servers = s.replace(
        free_at=jnp.where(go, finish, s.free_at),
        run_start=jnp.where(go, start, s.run_start),
        run_count=jnp.where(go, k, s.run_count),
        run_latency_sum=jnp.where(go, jnp.where(member, latency, 0.0).sum(-1),
                                  s.run_latency_sum),
        run_slo_met=jnp.where(go, (member & (latency <= slo_s)).sum(-1).astype(jnp.int32),
                              s.run_slo_met),
        run_estimate=jnp.where(go, est_o.sum(-1), s.run_estimate),
        est_end=jnp.where(go, start + est_service, s.est_end),
        batches=s.batches + go.astype(jnp.int32))
    shares = per_request_work(jax.tree.map(lambda x: x[:, None], gpus), win.prompt, win.estimate)
    popped_work = jnp.where(member, shares, 0.0).sum(-1)
    popped_est = jnp.where(member, win.estimate, 0.0).sum(-1)
    if log is not None and log.wait.shape[0] > 0:
        if win.req_id is None:
            raise ValueError("a RequestLog needs a cluster built with with_ids=True")
        idx = jnp.where(member, win.req_id, log.wait.shape[0]).ravel()
        wait = (start[:, None] - win.arrival).ravel()
        svc = jnp.broadcast_to(service[:, None], member.shape).ravel()
        bid = jnp.broadcast_to(s.batches[:, None], member.shape).ravel()
        log = RequestLog(wait=log.wait.at[idx].set(wait, mode="drop"),
                         service=log.service.at[idx].set(svc, mode="drop"),
                         batch=log.batch.at[idx].set(bid, mode="drop"))
    queues = Q.pop_front(q, k, popped_work, popped_est)
    return cluster.replace(queues=queues, servers=servers), log


def static_dispatch_time(cluster: Cluster, gpus: GPUProfile) -> jax.Array:
    """When each GPU's static batcher would next dispatch, were no request to arrive (s).

    `max(idle from, min(arrival of the B-th waiting request, head arrival + timeout))`, and
    never before the current instant 0. Meaningful where the GPU is idle and its queue non-empty.
    """
    q = cluster.queues
    b = batch_limit(cluster, gpus)
    head = Q.arrival_at(q, jnp.zeros_like(b))
    full = jnp.where(q.count >= b, Q.arrival_at(q, jnp.minimum(b, q.capacity) - 1), jnp.inf)
    trigger = jnp.minimum(full, head + gpus.timeout)
    return jnp.maximum(jnp.maximum(cluster.servers.free_at, trigger), 0.0)


def _due(cluster: Cluster, gpus: GPUProfile, horizon):
    s = cluster.servers
    completion = (s.run_count > 0) & (s.free_at <= horizon)
    idle_after = (s.run_count == 0) | completion
    # free_at of a completing batch is its end, so this start is already after it; and
    # completing a batch changes neither the start nor this flag, so both hold after it too.
    start = static_dispatch_time(cluster, gpus)
    dispatch_due = idle_after & (cluster.queues.count > 0) & (start < horizon)
    return completion, dispatch_due, start


def advance_static(cluster: Cluster, gpus: GPUProfile, horizon: jax.Array, slo_s: jax.Array,
                   log: RequestLog | None = None):
    """Runs every GPU's static batcher from time 0 up to `horizon` (s), with no arrivals.

    Processes completions at `t <= horizon` and dispatches at `t < horizon`. `horizon = inf`
    drains the system. Does not rebase the clock.

    Time-in-system over the window `[0, horizon]` uses
    `integral N(t) dt = sum over completions of k * t_c + N(horizon) * horizon`, which holds
    because `N` only falls inside the window (arrivals happen at its edges).

    Returns:
      (cluster, metrics for the window, log).
    """
    metrics = StepMetrics.zeros()

    def body(carry):
        cl, m, lg, completion, dispatch_due, start = carry
        done = jnp.where(completion, cl.servers.run_count * jnp.maximum(cl.servers.free_at, 0.0),
                         0.0)
        m = m.replace(in_system_time=m.in_system_time + done.sum())
        cl, m = complete_due(cl, completion, m)
        k = jnp.minimum(cl.queues.count, batch_limit(cl, gpus))
        cl, lg = dispatch(cl, gpus, dispatch_due, k, start, slo_s, lg)
        return (cl, m, lg, *_due(cl, gpus, horizon))

    # The due flags ride in the carry so each iteration evaluates them once, not in cond too.
    carry = (cluster, metrics, log, *_due(cluster, gpus, horizon))
    cluster, metrics, log, *_ = jax.lax.while_loop(
        lambda c: jnp.any(c[3] | c[4]), body, carry)
    finite = jnp.isfinite(horizon)
    h = jnp.where(finite, horizon, 0.0)
    s = cluster.servers
    running = s.run_count > 0
    metrics = metrics.replace(
        busy_time=metrics.busy_time
        + jnp.where(running & finite, h - jnp.maximum(s.run_start, 0.0), 0.0).sum(),
        in_system_time=metrics.in_system_time + in_system(cluster) * h,
        # A drain lasts until its last completion.
        elapsed=jnp.where(finite, h, jnp.maximum(s.free_at.max(), 0.0)))
    return cluster, metrics, log


def rebase(cluster: Cluster, dt: jax.Array) -> Cluster:
    """Moves the clock origin `dt` seconds forward (every stored time minus `dt`)."""
    q, s = cluster.queues, cluster.servers
    return cluster.replace(
        queues=q.replace(arrival=q.arrival - dt),
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
