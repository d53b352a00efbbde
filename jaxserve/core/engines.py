"""The serving engines behind one interface, for environments that can run either.

`STATIC` is the static batcher of `core.cluster` (MODEL.md), `CONTINUOUS` the
continuous-batching engine of `core.continuous` (MODEL_CONTINUOUS.md). An environment written
against `Engine` runs unchanged on either: Autoscaling-v0's step (advance between arrivals,
route each arrival, release drained replicas), and the routing environments' step
(`envs.routing_step.route_and_advance`: route one request, advance to the next arrival with
the per-request log, rebase). Each method is a thin call into the engine module, so no
mechanics are duplicated.

Clock convention (both engines): stored times are relative to the current instant; `advance`
runs to `horizon` without moving the origin, `rebase` moves it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jaxserve.core import cluster as C
from jaxserve.core import continuous as CB
from jaxserve.core import continuous_load as CL
from jaxserve.core import queues as Q
from jaxserve.core.service import per_request_work


@dataclasses.dataclass(frozen=True)
class Engine:
    """One engine's operations (all pure JAX except `empty`'s static sizes).

    Attributes:
      name: "static" or "continuous".
      empty: `(num_replicas, queue_buffer, slots) -> state`, an idle cluster; `slots` is the
        static batch bound (`max_batch`, or running slots `max_seqs`).
      advance: `(state, profiles, horizon, slo_s) -> (state, StepMetrics)`, no arrivals.
      advance_logged: `(state, profiles, horizon, slo_s, log, **engine_kw) -> (state,
        StepMetrics, extras, log)`: `advance` that also fills the per-request log
        (`cluster.RequestLog` / `continuous.TokenLog`; one of length 0 records nothing) and
        returns the engine's extra int32 counters of the window: `{}` for the static engine,
        `continuous.zero_extras()`'s keys (plus `continuous.PREFIX_EXTRAS` with prefix
        caching) for the continuous one. Engine keywords: the continuous engine's `tables=`
        (the trace's prefix tree, required with prefix caching).
      rebase: `(state, dt) -> state`, the clock origin `dt` seconds forward.
      route: `(state, profiles, request, replica, enabled=True) -> (state, dropped)`; where
        `enabled` is False the state is unchanged (every write dropped).
      route_flags: `(state, profiles, request, replica, enabled=True, **engine_kw) -> (state,
        dropped, flags)`: `route` taking the engine's keywords (continuous: `node=` and
        `tables=`, the request's prefix identity under prefix caching) and returning a dict
        of bool flags of the routed request beyond `dropped`: `{}` static, `{"never_fit":
        ...}` continuous (it can never fit the replica's KV cache; implies `dropped`).
      work: `(state, profiles) -> (R,)` estimated seconds of work each replica holds (from
        output estimates).
      request_work: `(one replica's profile, prompt, estimate) -> s` of replica time one
        request takes.
      held: `state -> (R,)` requests waiting or running at each replica. int32.
      idle_since: `state -> (R,)` when each replica's last batch / iteration ended (relative
        s); the release instant of a replica that holds nothing.
      slots: `profiles -> (R,)` the per-replica batch limit (`max_batch` / `max_seqs`).
      with_buffers: `(selected, written) -> state`, for masked loop bodies that gate
        `route` (`lanes.compacted_while(gated=True)`): `selected` (the lane-wise select of
        the body's output and input) with its per-slot queue buffers taken from `written`
        (the body's output) where that is exact, which saves a select over, and XLA's copy
        of, every buffer per iteration. Static engine: only `route` writes slot entries, so
        a gated route leaves them as they were on inactive lanes. Continuous engine:
        `advance` writes them too (preemptions put requests back), so it keeps `selected`.
    """

    name: str
    empty: Callable[..., Any]
    advance: Callable[..., Any]
    advance_logged: Callable[..., Any]
    rebase: Callable[..., Any]
    route: Callable[..., Any]
    route_flags: Callable[..., Any]
    work: Callable[..., jax.Array]
    request_work: Callable[..., jax.Array]
    held: Callable[[Any], jax.Array]
    idle_since: Callable[[Any], jax.Array]
    slots: Callable[[Any], jax.Array]
    with_buffers: Callable[[Any, Any], Any]


def _static_advance(cl, gpus, horizon, slo_s):
    cl, m, _ = C.advance_static(cl, gpus, horizon, slo_s)
    return cl, m


def _static_advance_logged(cl, gpus, horizon, slo_s, log):
    cl, m, log = C.advance_static(cl, gpus, horizon, slo_s, log)
    return cl, m, {}, log


def _static_route_flags(cl, gpus, req, gpu, enabled=True):
    cl, dropped = C.route(cl, gpus, req, gpu, enabled)
    return cl, dropped, {}


def _continuous_advance(rep, prof, horizon, slo_s):
    rep, m, _, _ = CB.advance(rep, prof, horizon, slo_s)
    return rep, m


def _continuous_advance_logged(rep, prof, horizon, slo_s, log, tables=None):
    return CB.advance(rep, prof, horizon, slo_s, log, tables=tables)


def _continuous_route(rep, prof, req, replica, enabled=True):
    rep, dropped, _ = CB.route(rep, prof, req, replica, enabled)
    return rep, dropped


def _continuous_route_flags(rep, prof, req, replica, enabled=True, node=None, tables=None):
    rep, dropped, never = CB.route(rep, prof, req, replica, enabled, node=node, tables=tables)
    return rep, dropped, {"never_fit": never}


STATIC = Engine(
    name="static",
    empty=lambda r, qb, slots: C.empty_cluster(r, qb, slots, with_ids=False),
    advance=_static_advance, advance_logged=_static_advance_logged, rebase=C.rebase,
    route=C.route, route_flags=_static_route_flags, work=C.queued_work,
    request_work=per_request_work,
    held=lambda cl: cl.queues.count + cl.servers.run_count,
    idle_since=lambda cl: cl.servers.free_at,
    slots=lambda gpus: gpus.max_batch,
    with_buffers=lambda cl, src: cl.replace(queues=Q.with_slots(cl.queues, src.queues)))

CONTINUOUS = Engine(
    name="continuous",
    empty=lambda r, qb, slots: CB.empty_replicas(r, qb, slots, with_ids=False),
    advance=_continuous_advance, advance_logged=_continuous_advance_logged, rebase=CB.rebase,
    route=_continuous_route, route_flags=_continuous_route_flags,
    work=CL.queued_work, request_work=CL.request_work,
    held=lambda rep: rep.queues.count + rep.run.count,
    # An idle replica's `t_end` is the end of its last iteration (its last completion).
    idle_since=lambda rep: rep.t_end,
    slots=lambda prof: prof.max_seqs,
    with_buffers=lambda rep, src: rep)
