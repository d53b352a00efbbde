"""The serving engines behind one interface: what environments, routers and rollouts call.

`STATIC` (a `StaticEngine`) is the static batcher of `core.cluster` (MODEL.md); `CONTINUOUS`
(a `ContinuousEngine`) the continuous-batching engine of `core.continuous`
(MODEL_CONTINUOUS.md). Both implement the `Engine` protocol, so code written against it runs
unchanged on either: Autoscaling-v0's step (advance between arrivals, route each arrival,
release drained replicas), the routing environments' step
(`envs.routing_step.route_and_advance`: route one request, advance to the next arrival with
the per-request log, rebase), their reward-shaping potentials and observations (`backlog`,
`marginal_backlog`, `work`), and routers that hold for both (`would_drop`). Each method is a
call into the engine's own module, so no mechanics are duplicated here; the continuous engine
adds what only its replicas have (KV blocks, tokens in flight, the prefix cache).

`engine_of(state)` picks the engine from the state's type, for code (routers) that receives a
state without being told which engine made it.

Variants of `advance` are the engine's own fields, so a benchmark or an A/B builds an engine
(`ContinuousEngine(decode_runs=False)`, `mode="one_pass"` or `"off"`) and hands it to an
environment (`env.with_engine(engine)`, `envs.base.StaticConfig`) instead of patching
functions: `mode="exact"` (the default) is the simulation; `"one_pass"` (continuous only)
cuts the boundary loop to one pass per `advance`, the least any engine doing a masked pass
per step pays, not exact (replicas fall behind); `"off"` makes `advance` return the state
unchanged with zero metrics, the cost of everything in a step but the engine. Only
`"exact"` simulates; the other two are measuring instruments (`scripts/bench.py --ceiling`,
`--profile`).

Clock convention (both engines): stored times are relative to the current instant; `advance`
runs to `horizon` without moving the origin, `rebase` moves it. Units: seconds and tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxserve.core import cluster as C
from jaxserve.core import continuous as CB
from jaxserve.core import continuous_load as CL
from jaxserve.core import queues as Q
from jaxserve.core import static_load as SL
from jaxserve.core.metrics import StepMetrics
from jaxserve.core.service import per_request_work

# `advance`'s variants (see the module docstring); `STATIC_MODES` are the static engine's.
MODES = ("exact", "one_pass", "off")
STATIC_MODES = ("exact", "off")


def _check_mode(engine, modes) -> None:
    if engine.mode not in modes:
        raise ValueError(f"{type(engine).__name__}.mode must be one of {modes}, got "
                         f"{engine.mode!r}")


class Engine(Protocol):
    """One serving engine's operations, all pure JAX (jit- and vmap-safe) except `empty`'s
    static sizes. `state` is the engine's cluster pytree (`cluster.Cluster` or
    `continuous.Replicas`), `profiles` its stacked per-replica profile (`GPUProfile` or
    `ReplicaProfile`), `request` a `queues.Request`."""

    name: str

    def empty(self, num_replicas: int, queue_buffer: int, slots: int, with_ids: bool = False,
              **engine_kw) -> Any:
        """An idle cluster; `slots` is the static batch bound (`max_batch`, or running slots
        `max_seqs`); `with_ids` keeps request ids in the queues (what a request log needs)."""

    def empty_log(self, length: int, **engine_kw) -> Any:
        """A per-request log of `length` requests, none seen yet."""

    def advance(self, state, profiles, horizon, slo_s) -> tuple[Any, Any]:
        """`(state, StepMetrics)`: the cluster run to `horizon` (s) with no arrivals."""

    def advance_logged(self, state, profiles, horizon, slo_s, log, **engine_kw):
        """`advance` that also fills the per-request log (`cluster.RequestLog` /
        `continuous.TokenLog`; one of length 0 records nothing): `(state, StepMetrics,
        extras, log)`, `extras` the engine's extra int32 counters of the window."""

    def rebase(self, state, dt) -> Any:
        """The clock origin moved `dt` seconds forward."""

    def route(self, state, profiles, request, replica, enabled=True) -> tuple[Any, jax.Array]:
        """`(state, dropped)`: `request` sent to `replica`; where `enabled` is False the
        state is unchanged (every write dropped)."""

    def route_flags(self, state, profiles, request, replica, enabled=True, **engine_kw):
        """`route` taking the engine's keywords, returning `(state, dropped, flags)`, `flags`
        a dict of bool facts of the routed request beyond `dropped`."""

    def would_drop(self, state, profiles, request) -> jax.Array:
        """`(R,)` bool: whether routing `request` to each replica drops it."""

    def work(self, state, profiles) -> jax.Array:
        """`(R,)` estimated seconds of work each replica holds (from output estimates)."""

    def request_work(self, profile, prompt, estimate) -> jax.Array:
        """Seconds of one replica's time one request of `prompt` tokens and output estimate
        `estimate` takes (in full batches)."""

    def backlog(self, state, profiles) -> jax.Array:
        """Expected remaining time-in-system of every request present, summed (s), from
        output estimates: the routing environments' reward-shaping potential."""

    def marginal_backlog(self, state, profiles, prompt, estimate) -> jax.Array:
        """`(R,)` s: how much `backlog` grows if a request of `prompt` tokens and output
        estimate `estimate` joins each replica."""

    def backlog_and_marginal(self, state, profiles, prompt, estimate):
        """`(backlog, marginal_backlog)` of one state."""

    def held(self, state) -> jax.Array:
        """`(R,)` int32 requests waiting or running at each replica."""

    def batches_run(self, state) -> jax.Array:
        """`(R,)` int32 batches (static) or iterations (continuous) each replica has run."""

    def finished(self, log) -> tuple[jax.Array, jax.Array]:
        """`(done, latency)` per logged request: whether it completed, and seconds from its
        arrival to its completion (NaN where not done)."""

    def idle_since(self, state) -> jax.Array:
        """`(R,)` when each replica's last batch / iteration ended (relative s): the release
        instant of a replica that holds nothing."""

    def slots(self, profiles) -> jax.Array:
        """`(R,)` the per-replica batch limit (`max_batch` / `max_seqs`)."""

    def with_buffers(self, selected, written) -> Any:
        """For masked loop bodies that gate `route` (`lanes.compacted_while(gated=True)`):
        `selected` (the lane-wise select of the body's output and input) with its per-slot
        queue buffers taken from `written` (the body's output) where that is exact, which
        saves a select over, and XLA's copy of, every buffer per iteration."""


@dataclasses.dataclass(frozen=True)
class StaticEngine:
    """The static batcher (`core.cluster`, MODEL.md): a replica runs one batch at a time,
    every request of it until the batch's longest output is done. Hashable (frozen fields), so
    it can be a static argument of `jax.jit`.

    Attributes:
      mode: `advance`'s variant, one of `STATIC_MODES` ("exact", the default; "off": the
        state unchanged, zero metrics; see the module docstring).
    """

    name: str = "static"
    mode: str = "exact"

    def __post_init__(self):
        _check_mode(self, STATIC_MODES)

    def empty(self, num_replicas, queue_buffer, slots, with_ids=False):
        return C.empty_cluster(num_replicas, queue_buffer, slots, with_ids=with_ids)

    def empty_log(self, length):
        """`cluster.RequestLog`: each request's wait, service and batch."""
        return C.empty_log(length)

    def advance(self, state, profiles, horizon, slo_s):
        state, m, _, _ = self.advance_logged(state, profiles, horizon, slo_s, None)
        return state, m

    def advance_logged(self, state, profiles, horizon, slo_s, log):
        """No engine keywords; `extras` is `{}`."""
        if self.mode == "off":
            return state, StepMetrics.zeros(), {}, log
        state, m, log = C.advance_static(state, profiles, horizon, slo_s, log)
        return state, m, {}, log

    def rebase(self, state, dt):
        return C.rebase(state, dt)

    def route(self, state, profiles, request, replica, enabled=True):
        return C.route(state, profiles, request, replica, enabled)

    def route_flags(self, state, profiles, request, replica, enabled=True):
        """No engine keywords; `flags` is `{}`."""
        state, dropped = C.route(state, profiles, request, replica, enabled)
        return state, dropped, {}

    def would_drop(self, state, profiles, request):
        """A full queue (`count >= queue_cap`) drops; any request fits a static batch."""
        return state.queues.count >= profiles.queue_cap

    def work(self, state, profiles):
        return C.queued_work(state, profiles)

    def request_work(self, profile, prompt, estimate):
        return per_request_work(profile, prompt, estimate)

    def backlog(self, state, profiles):
        """`static_load.expected_backlog`."""
        return SL.expected_backlog(state, profiles)

    def marginal_backlog(self, state, profiles, prompt, estimate):
        """`static_load.marginal_backlog`."""
        return SL.marginal_backlog(state, profiles, prompt, estimate)

    def backlog_and_marginal(self, state, profiles, prompt, estimate):
        return (SL.expected_backlog(state, profiles),
                SL.marginal_backlog(state, profiles, prompt, estimate))

    def held(self, state):
        return state.queues.count + state.servers.run_count

    def batches_run(self, state):
        return state.servers.batches

    def finished(self, log):
        """Dispatched requests (`batch >= 0`) finish their wait plus service after arrival."""
        done = log.batch >= 0
        return done, jnp.where(done, log.wait + log.service, jnp.nan)

    def idle_since(self, state):
        return state.servers.free_at

    def slots(self, profiles):
        return profiles.max_batch

    def with_buffers(self, selected, written):
        # Only `route` writes slot entries, so a gated route leaves them as they were on
        # inactive lanes: the body's output buffers are exact.
        return selected.replace(queues=Q.with_slots(selected.queues, written.queues))


@dataclasses.dataclass(frozen=True)
class ContinuousEngine:
    """The continuous-batching engine (`core.continuous`, MODEL_CONTINUOUS.md): iteration-level
    scheduling over a paged KV cache, chunked prefill, recompute preemption and, with a
    prefix tree, prefix caching. Beyond `Engine`, what only these replicas have: KV blocks in
    use, tokens in flight, the prefix cache's lookups and block accounting, expected SLO
    misses. Hashable (frozen fields), so it can be a static argument of `jax.jit`.

    Attributes:
      decode_runs: skip fixed pure-decode runs in closed form (the default); False runs a
        boundary per iteration (same results up to float32 rounding: tests, profiling).
      mode: `advance`'s variant, one of `MODES` ("exact", the default; "one_pass": one
        boundary pass per `advance`, not exact; "off": the state unchanged, zero metrics;
        see the module docstring).
    """

    name: str = "continuous"
    decode_runs: bool = True
    mode: str = "exact"

    def __post_init__(self):
        _check_mode(self, MODES)
        if not isinstance(self.decode_runs, bool):
            raise ValueError(f"ContinuousEngine.decode_runs must be a bool, got "
                             f"{self.decode_runs!r}")

    def empty(self, num_replicas, queue_buffer, slots, with_ids=False, prefix_blocks=None):
        """Engine keyword `prefix_blocks=`: the block-table width with prefix caching (None:
        no prefix cache)."""
        return CB.empty_replicas(num_replicas, queue_buffer, slots, with_ids=with_ids,
                                 prefix_blocks=prefix_blocks)

    def empty_log(self, length, prefix=False):
        """`continuous.TokenLog`: each request's TTFT, E2E and preemptions; `prefix` adds
        its cached tokens."""
        return CB.empty_log(length, prefix=prefix)

    def advance(self, state, profiles, horizon, slo_s):
        state, m, _, _ = self.advance_logged(state, profiles, horizon, slo_s, None)
        return state, m

    def advance_logged(self, state, profiles, horizon, slo_s, log, tables=None,
                       decode_runs=None, audit=False):
        """Engine keywords: `tables=`, the trace's prefix tree (required with prefix
        caching); `decode_runs=` overrides the engine's field for this call (None: the
        field); `audit=True` checks the block pool at every boundary
        (`continuous.prefix_audit`). `extras`: `continuous.zero_extras()`'s keys, plus
        `continuous.PREFIX_EXTRAS` with prefix caching (`zero_extras()` alone with
        `mode="off"`)."""
        if self.mode == "off":
            return state, StepMetrics.zeros(), CB.zero_extras(), log
        runs = self.decode_runs if decode_runs is None else decode_runs
        return CB.advance(state, profiles, horizon, slo_s, log, tables=tables,
                          decode_runs=runs, audit=audit,
                          passes="one" if self.mode == "one_pass" else "all")

    def rebase(self, state, dt):
        return CB.rebase(state, dt)

    def route(self, state, profiles, request, replica, enabled=True):
        state, dropped, _ = CB.route(state, profiles, request, replica, enabled)
        return state, dropped

    def route_flags(self, state, profiles, request, replica, enabled=True, node=None,
                    tables=None):
        """Engine keywords `node=` and `tables=`: the request's prefix identity under prefix
        caching. `flags`: `{"never_fit": ...}` (it can never fit the replica's KV cache or
        token budget; implies `dropped`)."""
        state, dropped, never = CB.route(state, profiles, request, replica, enabled,
                                         node=node, tables=tables)
        return state, dropped, {"never_fit": never}

    def would_drop(self, state, profiles, request):
        """A queue holding `queue_cap` fresh requests (preempted ones do not count), or a
        request that can never fit the replica's KV cache / token budget."""
        full = (state.queues.count - state.q_preempted) >= profiles.queue_cap
        return full | CB.never_fits(profiles, request.prompt, request.estimate)

    def work(self, state, profiles):
        return CL.queued_work(state, profiles)

    def request_work(self, profile, prompt, estimate):
        return CL.request_work(profile, prompt, estimate)

    def backlog(self, state, profiles):
        """`continuous_load.expected_backlog`."""
        return CL.expected_backlog(state, profiles)

    def marginal_backlog(self, state, profiles, prompt, estimate):
        """`continuous_load.marginal_backlog`."""
        return CL.marginal_backlog(state, profiles, prompt, estimate)

    def backlog_and_marginal(self, state, profiles, prompt, estimate):
        """`continuous_load.backlog_and_marginal`: their shared pairwise term computed once."""
        return CL.backlog_and_marginal(state, profiles, prompt, estimate)

    def expected_slo_misses(self, state, profiles, slo_ttft_s, slo_tpot_s):
        """`continuous_load.expected_slo_misses`: the SLO reward's shaping potential."""
        return CL.expected_slo_misses(state, profiles, slo_ttft_s, slo_tpot_s)

    def tokens_in_flight(self, state):
        """`(R,)` estimated tokens each replica holds (`continuous.tokens_in_flight`)."""
        return CB.tokens_in_flight(state)

    def kv_used(self, state, profiles):
        """`(R,)` KV blocks in use (`continuous.kv_used`)."""
        return CB.kv_used(state, profiles)

    def cached_prefix_blocks(self, state, profiles, tables, node, prompt):
        """`(R,)` int32 leading prompt blocks of a request (deepest prefix-tree node `node`)
        cached at each replica now (`continuous.cached_prefix_blocks`)."""
        return CB.cached_prefix_blocks(state, profiles, tables, node, prompt)

    def block_accounting(self, state, profiles):
        """Each replica's KV blocks by kind (`continuous.block_accounting`)."""
        return CB.block_accounting(state, profiles)

    def held(self, state):
        return state.queues.count + state.run.count

    def batches_run(self, state):
        return state.iterations

    def finished(self, log):
        """A request is done once its E2E latency is logged (finite)."""
        return jnp.isfinite(log.e2e), log.e2e

    def idle_since(self, state):
        # An idle replica's `t_end` is the end of its last iteration (its last completion).
        return state.t_end

    def slots(self, profiles):
        return profiles.max_seqs

    def with_buffers(self, selected, written):
        # `advance` writes slot entries too (preemptions put requests back), so the select
        # is kept whole.
        return selected


def route_and_run(engine: Engine, state, profiles, request, replica, horizon, drained, slo_s,
                  log, *, enabled=True, route_kw: dict | None = None,
                  advance_kw: dict | None = None):
    """One request's passage through the engine: `request` (arriving at time 0 of the clock)
    routed to `replica` (`route_flags`), the cluster run to `horizon` s with the per-request
    log (`advance_logged`), and the clock origin moved to `horizon` (`rebase`; by 0 where
    `drained`, the last request's `horizon = inf`, as no later event needs precise times).
    The loop every routing environment's step and every replay runs. Returns `(state,
    dropped, flags, metrics, extras, log)`: `route_flags`' `dropped` and `flags`, then
    `advance_logged`'s `StepMetrics`, extra counters and log.
    """
    state, dropped, flags = engine.route_flags(state, profiles, request, replica, enabled,
                                               **(route_kw or {}))
    state, metrics, extras, log = engine.advance_logged(state, profiles, horizon, slo_s, log,
                                                        **(advance_kw or {}))
    state = engine.rebase(state, jnp.where(drained, 0.0, horizon))
    return state, dropped, flags, metrics, extras, log


STATIC = StaticEngine()
CONTINUOUS = ContinuousEngine()


def engine_of(state) -> StaticEngine | ContinuousEngine:
    """The engine whose cluster state `state` is (`cluster.Cluster` -> `STATIC`,
    `continuous.Replicas` -> `CONTINUOUS`), read from its type at trace time.

    Raises:
      TypeError: `state` is neither.
    """
    if isinstance(state, CB.Replicas):
        return CONTINUOUS
    if isinstance(state, C.Cluster):
        return STATIC
    raise TypeError(f"not an engine state: {type(state).__name__} (expected cluster.Cluster "
                    f"or continuous.Replicas)")
