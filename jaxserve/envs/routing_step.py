"""The step every routing environment takes, written once for both serving engines.

Routing-v0 (static batching, `core.cluster`) and LLMRouting-v0 / LLMPrefixRouting-v0
(continuous batching, `core.continuous`) differ in their engine, observation and reward, not
in how one decision moves the system: the routed request joins its replica, the next request
is drawn, the engine runs to its arrival and the clock moves there. `route_and_advance` is
that skeleton, against `core.engines.Engine`, so a change to it (the order of route, draw and
advance; the drained-trace rebase; which counters a step reports) reaches every routing
environment at once instead of being kept in step by hand. Each environment keeps what is
its own around it: the action decoding, the requests it routes, the reward and shaping, the
observation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.core.engines import Engine, route_and_run
from jaxserve.core.metrics import StepMetrics
from jaxserve.core.queues import Request
from jaxserve.envs import common


class RoutedStep(NamedTuple):
    """What `route_and_advance` returns.

    Attributes:
      cluster: the engine state at the next request's arrival, its clock rebased there (times
        relative to that arrival, s), or left at the routed request's arrival when the trace
        is exhausted (the step drained the cluster).
      pending: the next request, arriving at time 0 of the new clock.
      phase: the arrival process's phase after the gap. int32.
      trace_pos: trace row of the next request (the routed one's plus 1). int32.
      exhausted: the trace has no next row: the step drained the cluster (gap `inf`); the
        environment's termination flag. bool.
      metrics: `StepMetrics` of the window from the routed request's arrival to the next
        one's (or to the drain), with `arrived` = 1, `dropped` (the routed request) and
        `invalid_actions` filled.
      extras: the engine's extra int32 counters of the window (`Engine.advance_logged`),
        then its routing flags as int32 counts (`Engine.route_flags`; LLMRouting-v0's
        `never_fit`). `{}` for the static engine.
      log: the per-request log after the window.
      dropped: whether the routed request was dropped. bool.
    """

    cluster: Any
    pending: Request
    phase: jax.Array
    trace_pos: jax.Array
    exhausted: jax.Array
    metrics: StepMetrics
    extras: dict
    log: Any
    dropped: jax.Array


def route_and_advance(engine: Engine, key: jax.Array, params: common.ServingParams, cluster,
                      pending: Request, replica: jax.Array, invalid: jax.Array,
                      phase: jax.Array, trace_pos: jax.Array, log, *,
                      routed: Request | None = None, u: jax.Array | None = None,
                      route_kw: dict | None = None,
                      advance_kw: dict | None = None) -> RoutedStep:
    """One routing decision's transition: draw the next arrival, then route, advance, rebase
    (`engines.route_and_run`).

    The pending request (arriving at time 0 of the clock, s) joins `replica`'s queue or is
    dropped (`Engine.route_flags`); the next request and the gap (s) before it are drawn
    (`common.next_arrival`, trace row `trace_pos + 1`, id `pending.req_id + 1`); the engine
    runs to that arrival with the per-request log (`Engine.advance_logged`; `gap = inf`
    drains it when the trace is exhausted) and its clock origin moves to that arrival
    (`Engine.rebase` by the gap; by 0 when drained, as no later event needs precise times).

    Args:
      engine: `core.engines.STATIC` or `CONTINUOUS`.
      key: the step's key; `next_arrival` draws from it (its uniforms `u` when given).
      cluster: the engine state, times relative to the pending request's arrival (s).
      replica: the decoded action (`common.discrete_action`), int32 in range.
      invalid: whether the action was invalid (counted in `metrics.invalid_actions`).
      phase, trace_pos: the arrival phase and the pending request's trace row.
      log: the per-request log (`RequestLog` / `TokenLog`, length 0 without one).
      routed: the request as routed, when it differs from `pending` (LLMRouting-v0's SLO
        reward renames its id to a log slot); the next arrival's id still follows
        `pending.req_id`.
      u: the next request's uniforms, when the caller shares that draw
        (`common.request_uniforms(key)`, Routing-v0's auto-reset).
      route_kw, advance_kw: engine keywords of `route_flags` and `advance_logged` (the
        continuous engine's `node=`/`tables=` and `tables=` under prefix caching).

    Returns:
      `RoutedStep`.
    """
    routed = pending if routed is None else routed
    nxt_pos = trace_pos + 1
    gap, req, phase, exhausted = common.next_arrival(
        key, params, phase, nxt_pos, pending.req_id + 1, u=u)
    cluster, dropped, flags, metrics, extras, log = route_and_run(
        engine, cluster, params.gpus, routed, replica, gap, exhausted, params.slo_s, log,
        route_kw=route_kw, advance_kw=advance_kw)
    metrics = metrics.replace(arrived=jnp.int32(1), dropped=dropped.astype(jnp.int32),
                              invalid_actions=invalid.astype(jnp.int32))
    extras = {**extras, **{k: f.astype(jnp.int32) for k, f in flags.items()}}
    return RoutedStep(cluster=cluster, pending=req, phase=phase, trace_pos=nxt_pos,
                      exhausted=exhausted, metrics=metrics, extras=extras, log=log,
                      dropped=dropped)
