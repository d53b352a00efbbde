"""Autoscaling-v0: choose how many inference replicas to pay for, at fixed control intervals.

The cluster is `max_replicas` replica slots behind a load balancer. Each slot is off, active
(warming up, then serving) or draining. At every control instant the agent sets the number of
active replicas; in between, requests arrive (Poisson/MMPP modulated by a diurnal cycle, or a
replayed trace), the balancer sends each to the serving replica with the least queued work, and
every replica runs the static batcher, exactly as in Routing-v0 (same engine, `core.cluster`).

Scaling semantics (what real autoscalers do):
  - scaling up first re-activates draining replicas (they are warm), then provisions off slots,
    which serve only after `warmup_s` (model load) but cost from the moment they are provisioned;
  - scaling down first cancels replicas still warming up, then drains the serving replicas with
    the least queued work: a draining replica takes no new requests, finishes what it holds and
    is released (stops costing) at its last completion;
  - at least one replica always serves, so the balancer always has a destination.

GPU-seconds of an interval are the integral of provisioned replicas over it, computed exactly
from the release instants. The reward charges them at `gpu_price` (request-seconds per
GPU-second), so `vmap` over prices trains or evaluates a family of cost-latency trade-offs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import environment, spaces

from jaxserve.core import cluster as C
from jaxserve.core import engines
from jaxserve.core import queues as Q
from jaxserve.core import rng
from jaxserve.core.lanes import compacted_while
from jaxserve.core.metrics import StepMetrics
from jaxserve.core.profiles import get_profile
from jaxserve.core.tree import select
from jaxserve.core.types import MAX_SECONDS, check_int_array, numeric_array
from jaxserve.envs import common
from jaxserve.envs.autoscaling_workloads import workload_overrides
from jaxserve.envs.base import StaticConfig, as_size, check_sizes, clip_features, feature_box
from jaxserve.envs.defaults import (TRACE_EPISODE_STEPS, build_params, fill_defaults,
                                    static_sizes)
from jaxserve.envs.routing import routing_tokens

OFF, ACTIVE, DRAINING = 0, 1, 2

# Per-interval record kept in `AutoscalingState.history` (most recent first), read by the
# baseline autoscalers (`jaxserve.policies.autoscaling`), which need windows of past metrics.
HISTORY_FIELDS = (
    "arrivals",        # requests that arrived in the interval
    "completed",       # requests completed in the interval
    "dropped",         # requests refused by a full queue
    "concurrency",     # time-average requests in system (waiting + running)
    "utilization",     # busy GPU-seconds / serving replica-seconds, in [0, 1]
    "active",          # replicas active (warming or serving) after the interval's decision
    "serving",         # replicas serving at the interval's end
    "provisioned",     # replicas costing at the interval's end (active + draining)
    "offered_load",    # arrived work (ENGINE.request_work, estimates) / interval: replicas
    "latency_sum",     # summed latency of the interval's completions (s)
    "slo_violations",  # completions over the SLO
    "gpu_seconds",     # provisioned GPU-seconds in the interval
)
H = {name: i for i, name in enumerate(HISTORY_FIELDS)}
# `log.batch` of a request refused by a full queue (-1: not dispatched yet, >= 0: dispatched).
LOG_DROPPED = -2
NUM_FEATURES = 16


@struct.dataclass
class AutoscalingParams:
    """Vmappable parameters of Autoscaling-v0.

    Attributes:
      serving: the request/GPU model shared with the other environments (`gpus` has one entry
        per replica slot; arrivals, tokens, SLO, latency_scale, drop penalty, episode length).
      control_interval_s: seconds between scaling decisions (one env step).
      warmup_s: seconds from provisioning a replica until it serves (it costs meanwhile).
      gpu_price: cost of one provisioned replica-second, in request-seconds of latency.
      latency_weight: cost of one request-second in system (0 leaves only SLO/drop costs).
      slo_penalty_s: extra cost of each completion over `serving.slo_s`, in request-seconds.
      diurnal_amplitude: relative amplitude `a` in [0, 1) of the arrival-rate cycle
        `1 + a sin(2 pi (t + diurnal_phase_s) / diurnal_period_s)`; 0 with a trace. The rate
        is held at its value at the start of each control interval (piecewise constant), and
        the arrival process runs in time warped by it: exact for Poisson arrivals.
      diurnal_period_s: the cycle's period (s).
      diurnal_phase_s: time of day at reset (s).
      initial_replicas: replicas serving at reset (warm). int32.
      action_mode: 0: action `a` asks for `a + 1` active replicas (a target); 1: it changes
        the active count by `a - max_replicas // 2` (a step, e.g. -4..+3 with 8 slots), which
        explores more smoothly (a random policy random-walks instead of thrashing warm-ups).
        Use `action_for_target` to act by target in either mode. int32.
      random_phase: 1 draws the time of day at reset uniformly over the cycle (added to
        `diurnal_phase_s`) from the reset key, so vmapped episodes are not in lockstep and a
        policy sees every time of day in every batch; 0 starts every episode at
        `diurnal_phase_s`. int32.
      random_initial: 1 draws the replicas serving at reset uniformly from `[1, R]` (warm)
        instead of `initial_replicas`, so training visits every (time of day, count) pair;
        0 uses `initial_replicas`. int32.
      invalid_penalty_s: cost of each invalid action (out of range, or a step clipped at
        `[1, R]`), in request-seconds; 0 (the default) leaves clipping free, which lets a
        step policy push against the bound at no cost. float32.
      price_spread: `s >= 1`; each episode's price is drawn at reset log-uniformly in
        `[gpu_price / s, gpu_price * s]` (kept in `AutoscalingState.gpu_price`, seen in the
        observation), so one training run learns a price-conditioned policy whose operating
        point is chosen afterwards by the price it is told; 1 (the default) keeps `gpu_price`.
      random_offset: 1 starts a replayed trace at a uniformly drawn row (its request
        arriving at time 0), so training episodes are windows of the trace from random
        offsets; 0 starts at the first row. Ignored without a trace. int32.
    """

    # The defaults (Python numbers, as gymnax's `EnvParams()`; `scaling_params` casts them):
    # a compressed day (2 h) of diurnal Poisson traffic, decided every 15 s (Kubernetes
    # HPA's sync period); a replica of Llama-2-70B needs ~2 min to load.
    serving: common.ServingParams
    control_interval_s: jax.Array = 15.0
    warmup_s: jax.Array = 120.0
    gpu_price: jax.Array = 4.0
    latency_weight: jax.Array = 1.0
    slo_penalty_s: jax.Array = 0.0
    diurnal_amplitude: jax.Array = 0.6
    diurnal_period_s: jax.Array = 7200.0
    diurnal_phase_s: jax.Array = 0.0
    initial_replicas: jax.Array = 2
    action_mode: jax.Array = 0
    random_phase: jax.Array = 0
    random_initial: jax.Array = 0
    invalid_penalty_s: jax.Array = 0.0
    price_spread: jax.Array = 1.0
    random_offset: jax.Array = 0

    @property
    def max_steps_in_episode(self) -> jax.Array:
        return self.serving.max_steps_in_episode


SCALING_FIELDS = {
    "control_interval_s": jnp.float32, "warmup_s": jnp.float32, "gpu_price": jnp.float32,
    "latency_weight": jnp.float32, "slo_penalty_s": jnp.float32,
    "diurnal_amplitude": jnp.float32, "diurnal_period_s": jnp.float32,
    "diurnal_phase_s": jnp.float32, "initial_replicas": jnp.int32, "action_mode": jnp.int32,
    "random_phase": jnp.int32, "random_initial": jnp.int32, "invalid_penalty_s": jnp.float32,
    "price_spread": jnp.float32, "random_offset": jnp.int32,
}
TARGET, DELTA = 0, 1


@struct.dataclass
class AutoscalingState:
    """State of an Autoscaling-v0 episode at a control instant (time 0 of the relative clock).

    Attributes:
      cluster: queues and running batches of every replica slot.
      upcoming: the next request to arrive; its `arrival` is when (s, relative; inf if none).
      mode: `(R,)` int32, OFF / ACTIVE / DRAINING per slot.
      ready_at: `(R,)` when each active slot finishes warming up (s, relative; <= 0: serving).
      phase: arrival-process phase. int32.
      trace_pos: trace row of `upcoming`. int32.
      clock: time of day (s), in `[0, diurnal_period_s)`; kept modulo the period so it stays
        precise in float32 however long the episode runs.
      since_scale_up, since_scale_down: seconds since the active count last rose / fell
        (capped at 1e6).
      history: `(history_len, len(HISTORY_FIELDS))` per-interval records, row 0 the latest.
      time: control intervals taken this episode. int32.
      gpu_price: this episode's price of a replica-second (request-seconds): `params.gpu_price`,
        or drawn at reset with `params.price_spread > 1`. float32.
      log: per-request schedule of the episode's first `log_capacity` requests, indexed by
        request id (arrival order); empty unless the env was built with `log_capacity > 0`
        (`evaluation.scaling` does, for exact latency percentiles).
    """

    cluster: C.Cluster
    upcoming: Q.Request
    mode: jax.Array
    ready_at: jax.Array
    phase: jax.Array
    trace_pos: jax.Array
    clock: jax.Array
    since_scale_up: jax.Array
    since_scale_down: jax.Array
    history: jax.Array
    time: jax.Array
    gpu_price: jax.Array
    log: C.RequestLog


def rate_multiplier(clock, params: AutoscalingParams) -> jax.Array:
    """Diurnal arrival-rate multiplier at time of day `clock` (s); 1 without a cycle."""
    angle = 2.0 * jnp.pi * clock / params.diurnal_period_s
    return (1.0 + params.diurnal_amplitude * jnp.sin(angle)).astype(jnp.float32)


def serving_mask(mode, ready_at) -> jax.Array:
    """Slots that take new requests now: active and warmed up."""
    return (mode == ACTIVE) & (ready_at <= 0.0)


def counts(state: AutoscalingState) -> dict[str, jax.Array]:
    """Replica counts (int32): active, serving, warming, draining, provisioned."""
    active = state.mode == ACTIVE
    serving = serving_mask(state.mode, state.ready_at)
    draining = state.mode == DRAINING
    return {"active": active.sum(), "serving": serving.sum(), "warming": (active & ~serving).sum(),
            "draining": draining.sum(), "provisioned": (active | draining).sum()}


def target_from_action(action, state: AutoscalingState, params: AutoscalingParams,
                       max_replicas: int):
    """The active count an action asks for, clipped to `[1, R]`, and whether it was invalid.

    An action that is not an integer in `[0, R)` (out of range, non-integral, NaN/inf) is
    invalid and mapped by `common.discrete_action` (clipped, floored, NaN to 0)."""
    a, bad = common.discrete_action(action, max_replicas)
    asked = jnp.where(params.action_mode == DELTA,
                      (state.mode == ACTIVE).sum() + a - max_replicas // 2, a + 1)
    target = jnp.clip(asked, 1, max_replicas)
    return target.astype(jnp.int32), bad | (asked != target)


def action_for_target(target, state: AutoscalingState, params: AutoscalingParams,
                      max_replicas: int) -> jax.Array:
    """The action that asks for `target` active replicas (clipped to what one step can do)."""
    target = jnp.clip(jnp.asarray(target, jnp.int32), 1, max_replicas)
    delta = target - (state.mode == ACTIVE).sum() + max_replicas // 2
    return jnp.where(params.action_mode == DELTA, jnp.clip(delta, 0, max_replicas - 1),
                     target - 1).astype(jnp.int32)


def apply_target(state: AutoscalingState, target, params: AutoscalingParams, work):
    """Sets the number of active replicas to `target` at the current instant (see module doc).

    Args:
      target: int32 in `[1, R]`.
      work: `(R,)` queued work per slot (s), to pick which serving replicas drain.

    Returns:
      `(mode, ready_at, scaled_up, scaled_down)`.
    """
    mode, ready_at = state.mode, state.ready_at
    r = mode.shape[0]
    idx = jnp.arange(r)
    active = mode == ACTIVE
    serving = serving_mask(mode, ready_at)
    n_active = active.sum()
    up = jnp.maximum(target - n_active, 0)
    down = jnp.maximum(n_active - target, 0)

    def choose(priority, n):
        # The n slots of lowest priority (finite priorities only): rank by a stable sort.
        rank = jnp.argsort(jnp.argsort(priority, stable=True), stable=True)
        return (rank < n) & jnp.isfinite(priority)

    # Up: draining slots first (warm, no warm-up), then off slots, lowest index first.
    up_priority = jnp.where(mode == DRAINING, idx, jnp.where(mode == OFF, r + idx, jnp.inf))
    pick_up = choose(up_priority.astype(jnp.float32), up)
    # Down: warming slots first (latest ready first: their ready_at > 0 sorts them before any
    # serving slot's work >= 0), then serving slots with least work.
    warming = active & ~serving
    down_priority = jnp.where(warming, -ready_at, jnp.where(serving, work, jnp.inf))
    pick_down = choose(down_priority.astype(jnp.float32), down)

    new_mode = jnp.where(pick_up, ACTIVE, mode)
    new_ready = jnp.where(pick_up & (mode == OFF), params.warmup_s, ready_at)
    new_mode = jnp.where(pick_down & warming, OFF, new_mode)
    new_mode = jnp.where(pick_down & serving, DRAINING, new_mode)
    return new_mode, new_ready.astype(jnp.float32), up > 0, down > 0


@dataclasses.dataclass(frozen=True)
class AutoscalingStatic:
    """Static configuration of Autoscaling-v0 and LLMAutoscaling-v0 (`envs.base.StaticConfig`).

    Attributes:
      max_replicas: replica slots (the action space's size), >= 1.
      queue_buffer: queue slots per replica (>= every `queue_cap`), >= 1.
      max_batch: running slots per replica (>= every profile's `max_batch`), >= 1.
      trace_len: rows of a replayed trace (0: synthetic arrivals).
      history_len: per-interval records kept in the state, >= 1.
      log_capacity: requests kept in the per-request log (0: no log). Evaluation only
        (`with_static(env, log_capacity=n)`): training keeps 0 and pays nothing.
    """

    max_replicas: int
    queue_buffer: int = 64
    max_batch: int = 16
    trace_len: int = 0
    history_len: int = 64
    log_capacity: int = 0

    def __post_init__(self):
        check_sizes(self, positive=("max_replicas", "history_len"),
                    nonnegative=("trace_len", "log_capacity"),
                    slots=("queue_buffer", "max_batch"))


class Autoscaling(StaticConfig, environment.Environment[AutoscalingState, AutoscalingParams]):
    """Set the number of active replicas every `control_interval_s`; pay GPU-seconds.

    Decision epochs: every `control_interval_s` seconds of simulated time.
    Action: `Discrete(max_replicas)`; action `a` asks for `a + 1` active replicas, or with
      `params.action_mode = 1` for `active + a - max_replicas // 2`. Actions that are not an
      integer in `[0, max_replicas)` (out of range, non-integral or non-finite: floored and
      clipped, NaN to 0, by `common.discrete_action`), and steps past `[1, max_replicas]`,
      are counted in `info["invalid_actions"]`.
    Observation: float32 `(16,)` in [0, 1000] (`FEATURES` names them): replica counts as
      fractions of `max_replicas` (active, serving, warming, draining), last interval's offered
      load in replicas (arrived work / interval), the one before it, requests in system per
      serving replica / max_batch, utilisation, waiting / total queue capacity, mean latency /
      SLO, SLO-violation and drop fractions, the time of day as `(1 + sin, 1 + cos) / 2`, the
      price as `p / (1 + p)` and the mean remaining warm-up / `warmup_s`.
    Reward: `-(latency_weight * time-in-system + slo_penalty_s * SLO violations
      + drop_penalty_s * drops + gpu_price * GPU-seconds + invalid_penalty_s * invalid)
      / latency_scale` over the interval.
    Termination: with a replayed trace, once it has ended and the cluster has drained.
      Truncation after `max_steps_in_episode` intervals.
    Info: `StepMetrics` fields plus `gpu_seconds`, `active`, `serving`, `provisioned` and
      `slo_violations`.
    """

    policy_kind = "autoscaling"  # registered policies that act here (envs.base)
    Static = AutoscalingStatic  # static configuration (`env.static`; fields read as attributes)
    # The serving engine (`core.engines`); LLMAutoscaling-v0 swaps in continuous batching.
    ENGINE = engines.STATIC

    FEATURES = ("active", "serving", "warming", "draining", "offered_load", "offered_load_prev",
                "concurrency_per_replica", "utilization", "waiting", "latency_over_slo",
                "slo_violation_frac", "drop_frac", "day_sin", "day_cos", "price",
                "warmup_left")

    def _running_slots(self) -> int:
        """The static batch bound per replica (`Engine.empty`'s `slots`): `max_batch` here,
        `max_seqs` in LLMAutoscaling-v0 (each named as its profile field)."""
        return self.max_batch

    def __init__(self, *args, default: AutoscalingParams | None = None, **fields):
        super().__init__(*args, default=default, **fields)
        if self.log_capacity > 0 and not isinstance(self.ENGINE, engines.StaticEngine):
            raise ValueError(f"{self.ENGINE.name} replicas keep no request log (log_capacity "
                             f"must be 0)")

    @property
    def num_gpus(self) -> int:
        """Alias of `max_replicas` (what the shared checks and routing helpers read)."""
        return self.max_replicas

    @property
    def name(self) -> str:
        return "Autoscaling-v0"

    @property
    def num_actions(self) -> int:
        return self.max_replicas

    def check_params(self, params: AutoscalingParams) -> None:
        """Raises ValueError (naming the field) if `params` do not fit this environment."""
        validate_scaling_params(params, self.queue_buffer, self.max_batch, self.max_replicas)

    # ------------------------------------------------------------------------------- reset
    def reset_env(self, key, params):
        sp = params.serving
        k_phase, k_req = rng.split(key)
        phase = common.first_phase(k_phase, sp)
        # Draws beyond the request stream come from keys folded out of `key`, so a key's
        # requests are the same whatever the training flags (common random numbers).
        pos0 = jnp.where(params.random_offset == 1,
                         jax.random.randint(jax.random.fold_in(key, 0x4F464653), (), 0,
                                            jnp.maximum(sp.trace.length, 1)), 0)
        gap, req, phase, _ = common.next_arrival(k_req, sp, phase, pos0.astype(jnp.int32),
                                                 jnp.int32(0))
        offset = jax.random.uniform(jax.random.fold_in(key, 0x50484153), (),
                                    maxval=params.diurnal_period_s)
        clock = jnp.mod(params.diurnal_phase_s + jnp.where(params.random_phase == 1, offset, 0.0),
                        params.diurnal_period_s).astype(jnp.float32)
        # A synthetic first request arrives after one gap at the current rate; a trace's at 0.
        is_trace = sp.trace.gap.shape[0] > 0
        first = jnp.where(pos0 > 0, 0.0, gap) if is_trace else gap / rate_multiplier(clock,
                                                                                   params)
        n_rand = jax.random.randint(jax.random.fold_in(key, 0x494E4954), (), 1,
                                    self.max_replicas + 1)
        n0 = jnp.clip(jnp.where(params.random_initial == 1, n_rand, params.initial_replicas),
                      1, self.max_replicas)
        # log-uniform in [p / s, p * s]; exactly p at s = 1.
        u = jax.random.uniform(jax.random.fold_in(key, 0x50524943), (), minval=-1.0, maxval=1.0)
        price = jnp.where(params.price_spread > 1.0,
                          params.gpu_price * params.price_spread ** u, params.gpu_price)
        r = self.max_replicas
        cluster = self.ENGINE.empty(r, self.queue_buffer, self._running_slots(),
                                    with_ids=self.log_capacity > 0)
        state = AutoscalingState(
            cluster=cluster,
            upcoming=req.replace(arrival=jnp.asarray(first, jnp.float32)),
            mode=jnp.where(jnp.arange(r) < n0, ACTIVE, OFF).astype(jnp.int32),
            ready_at=jnp.zeros((r,), jnp.float32), phase=phase, trace_pos=pos0.astype(jnp.int32),
            clock=clock, since_scale_up=jnp.float32(1e6), since_scale_down=jnp.float32(1e6),
            history=jnp.zeros((self.history_len, len(HISTORY_FIELDS)), jnp.float32),
            time=jnp.int32(0), gpu_price=jnp.asarray(price, jnp.float32),
            log=self.ENGINE.empty_log(self.log_capacity))
        return self.get_obs(state, params), state

    # -------------------------------------------------------------------------------- step
    def step_env(self, key, state, action, params):
        sp = params.serving
        gpus = sp.gpus
        dt = params.control_interval_s
        target, invalid = target_from_action(action, state, params, self.max_replicas)
        eng = self.ENGINE
        mode, ready_at, up, down = apply_target(state, target, params,
                                                eng.work(state.cluster, gpus))
        provisioned0 = mode != OFF
        # Serving time of each slot inside [0, dt] starts when its warm-up ends.
        serve_from = jnp.clip(ready_at, 0.0, dt)
        mult = rate_multiplier(state.clock, params)

        def cond(c, consts):
            nxt, t = c[1], c[5]
            return nxt.arrival < consts[3] - t

        def body(c, consts, active):
            params, mode, mult, _ = consts
            sp = params.serving
            gpus = sp.gpus
            cl, nxt, phase, pos, rdy, t, m, work_in, key, lg = c
            key, k_next = rng.split(key)
            gap = nxt.arrival
            cl, m_adv, lg = self._advance(cl, gpus, gap, sp.slo_s, lg)
            cl = eng.rebase(cl, gap)
            rdy = rdy - gap
            # Least queued work among serving slots (ties: lowest index).
            serving = serving_mask(mode, rdy)
            work = jnp.where(serving, eng.work(cl, gpus), jnp.inf)
            gpu = jnp.argmin(work).astype(jnp.int32)
            req = nxt.replace(arrival=jnp.float32(0.0))
            # Gated (`lanes.compacted_while`): an inactive lane writes no queue slot, so its
            # slot buffers pass through without a select over (and a copy of) all of them.
            cl, dropped = eng.route(cl, gpus, req, gpu, active)
            lg = self._log_drop(lg, req.req_id, dropped)
            share = eng.request_work(jax.tree.map(lambda x: x[gpu], gpus), req.prompt,
                                     req.estimate)
            ogap, new, phase, exhausted = common.next_arrival(k_next, sp, phase, pos + 1,
                                                              nxt.req_id + 1)
            rgap = jnp.where(exhausted | (sp.trace.gap.shape[0] > 0), ogap, ogap / mult)
            m = m + m_adv.replace(arrived=jnp.int32(1), dropped=dropped.astype(jnp.int32))
            out = (cl, new.replace(arrival=rgap.astype(jnp.float32)), phase, pos + 1, rdy,
                   t + gap, m, work_in + share, key, lg)
            out = select(active, out, c)
            return (eng.with_buffers(out[0], cl), *out[1:])

        # Why the loop ends: each iteration is one arrival inside the interval `[0, dt)`; it
        # stops at the first arrival due at or after `dt - t`. With a trace every iteration
        # consumes a row and an exhausted trace's gap is inf: at most `trace_len` iterations.
        # With synthetic arrivals the rate in the interval is at most `r * (1 + a) < 2 r`,
        # and `validate_scaling_params` bounds `2 r * dt <= 2^23`
        # (`common.check_arrival_horizon`): each gap then moves the float32 clock `t`
        # (< dt) with probability > 0.36, so the loop ends after about `2 r dt` arrivals and
        # never spins on `t + gap == t`.
        carry = (state.cluster, state.upcoming, state.phase, state.trace_pos, ready_at,
                 jnp.float32(0.0), StepMetrics.zeros(), jnp.float32(0.0), key, state.log)
        # Under vmap the lanes' arrival counts per interval differ (diurnal rates, bursts), so
        # the loop compacts its lanes (`lanes.compacted_while`); the body reads every traced
        # value through `consts`.
        cl, nxt, phase, pos, rdy, t, m, work_in, _, lg = compacted_while(
            cond, body, carry, (params, mode, mult, dt), gated=True)
        rest = dt - t
        cl, m_adv, lg = self._advance(cl, gpus, rest, sp.slo_s, lg)
        m = m + m_adv
        cl = eng.rebase(cl, rest)
        rdy = rdy - rest
        arrival_left = nxt.arrival - rest

        # Release drained replicas at their last completion (relative to the interval end).
        empty = eng.held(cl) == 0
        released = (mode == DRAINING) & empty
        release_at = jnp.where(released, jnp.clip(dt + eng.idle_since(cl), 0.0, dt), dt)
        gpu_seconds = jnp.where(provisioned0, release_at, 0.0).sum()
        mode = jnp.where(released, OFF, mode)
        # Replica-seconds able to serve (warmed up, not yet released): utilisation's base.
        serving_seconds = jnp.where(provisioned0, jnp.maximum(release_at - serve_from, 0.0),
                                    0.0).sum()

        # The next interval's rate: rescale the pending gap (exact for the time-warped
        # process, since its remaining operational time is memoryless at a fixed phase).
        clock = jnp.mod(state.clock + dt, params.diurnal_period_s)
        new_mult = rate_multiplier(clock, params)
        is_trace = sp.trace.gap.shape[0] > 0
        arrival_left = jnp.where(is_trace | ~jnp.isfinite(arrival_left), arrival_left,
                                 arrival_left * mult / new_mult)

        slo_violations = m.completed - m.slo_met
        m = m.replace(elapsed=dt, invalid_actions=invalid.astype(jnp.int32))
        new_state = state.replace(
            cluster=cl, upcoming=nxt.replace(arrival=arrival_left.astype(jnp.float32)),
            mode=mode.astype(jnp.int32), ready_at=jnp.maximum(rdy, -1.0).astype(jnp.float32),
            phase=phase, trace_pos=pos, clock=clock.astype(jnp.float32),
            since_scale_up=jnp.minimum(jnp.where(up, 0.0, state.since_scale_up) + dt, 1e6),
            since_scale_down=jnp.minimum(jnp.where(down, 0.0, state.since_scale_down) + dt, 1e6),
            time=state.time + 1, log=lg)
        c = counts(new_state)
        record = jnp.zeros((len(HISTORY_FIELDS),), jnp.float32)
        values = {
            "arrivals": m.arrived, "completed": m.completed, "dropped": m.dropped,
            "concurrency": m.in_system_time / dt,
            "utilization": m.busy_time / jnp.maximum(serving_seconds, 1e-6),
            "active": (mode == ACTIVE).sum(), "serving": c["serving"],
            "provisioned": c["provisioned"], "offered_load": work_in / dt,
            "latency_sum": m.latency_sum, "slo_violations": slo_violations,
            "gpu_seconds": gpu_seconds,
        }
        for name, v in values.items():
            record = record.at[H[name]].set(jnp.asarray(v, jnp.float32))
        record = jnp.clip(jnp.nan_to_num(record), 0.0, 1e9)
        record = record.at[H["utilization"]].set(jnp.minimum(record[H["utilization"]], 1.0))
        history = jnp.concatenate([record[None], state.history[:-1]], axis=0)
        new_state = new_state.replace(history=history)

        cost = (params.latency_weight * m.in_system_time + params.slo_penalty_s * slo_violations
                + sp.drop_penalty_s * m.dropped + state.gpu_price * gpu_seconds
                + params.invalid_penalty_s * invalid)
        reward = (-cost / sp.latency_scale).astype(jnp.float32)
        info = {**m.as_dict(), "gpu_seconds": gpu_seconds.astype(jnp.float32),
                "slo_violations": slo_violations, "active": values["active"].astype(jnp.int32),
                "serving": c["serving"], "provisioned": c["provisioned"]}
        return (self.get_obs(new_state, params), new_state, reward,
                self.is_terminated(new_state, params), info)

    def _advance(self, cl, gpus, horizon, slo_s, log):
        """The engine's `advance`, writing each dispatched request's schedule into `log` when
        the env keeps one (static batching only; checked in the constructor)."""
        if self.log_capacity > 0:
            cl, m, _, log = self.ENGINE.advance_logged(cl, gpus, horizon, slo_s, log)
            return cl, m, log
        cl, m = self.ENGINE.advance(cl, gpus, horizon, slo_s)
        return cl, m, log

    def _log_drop(self, log, req_id, dropped):
        """Marks a refused request `LOG_DROPPED` in the log (an arriving request is not yet
        dispatched, so its entry is -1 otherwise); no-op without a log."""
        if self.log_capacity == 0:
            return log
        return log.replace(batch=log.batch.at[req_id].set(
            jnp.where(dropped, LOG_DROPPED, -1).astype(jnp.int32), mode="drop"))

    # ------------------------------------------------------------------------- observation
    def get_obs(self, state, params=None, key=None):
        p = params
        sp = p.serving
        r = jnp.float32(self.max_replicas)
        c = counts(state)
        h0, h1 = state.history[0], state.history[1 % self.history_len]
        serving = jnp.maximum(c["serving"].astype(jnp.float32), 1.0)
        completed = jnp.maximum(h0[H["completed"]], 1.0)
        arrivals = jnp.maximum(h0[H["arrivals"]], 1.0)
        cl = state.cluster
        in_system = self.ENGINE.held(cl).sum().astype(jnp.float32)
        waiting_cap = jnp.maximum(sp.gpus.queue_cap.sum(), 1).astype(jnp.float32)
        angle = 2.0 * jnp.pi * state.clock / p.diurnal_period_s
        warming = (state.mode == ACTIVE) & (state.ready_at > 0)
        warm_left = jnp.where(warming, state.ready_at, 0.0).sum() / jnp.maximum(warming.sum(), 1)
        feats = jnp.stack([
            c["active"] / r, c["serving"] / r, c["warming"] / r, c["draining"] / r,
            h0[H["offered_load"]], h1[H["offered_load"]],
            in_system / serving / jnp.maximum(self.ENGINE.slots(sp.gpus)[0], 1),
            h0[H["utilization"]],
            cl.queues.count.sum() / waiting_cap,
            h0[H["latency_sum"]] / completed / sp.slo_s,
            h0[H["slo_violations"]] / completed,
            h0[H["dropped"]] / arrivals,
            (1.0 + jnp.sin(angle)) / 2.0, (1.0 + jnp.cos(angle)) / 2.0,
            state.gpu_price / (1.0 + state.gpu_price),
            warm_left / jnp.maximum(p.warmup_s, 1e-6),
        ])
        return clip_features(feats)

    def is_terminated(self, state, params):
        cl = state.cluster
        empty = self.ENGINE.held(cl).sum() == 0
        return (params.serving.trace.gap.shape[0] > 0) & ~jnp.isfinite(state.upcoming.arrival) \
            & empty

    def action_space(self, params=None):
        return spaces.Discrete(self.max_replicas)

    def observation_space(self, params=None):
        return feature_box((NUM_FEATURES,))

    def state_space(self, params=None) -> Any:
        raise NotImplementedError("Autoscaling-v0 exposes its state as the AutoscalingState "
                                  "pytree")


def validate_scaling_params(params: AutoscalingParams, queue_buffer: int, max_batch: int,
                            max_replicas: int) -> None:
    """Host-side checks of `AutoscalingParams`; raises ValueError naming the field."""
    if not isinstance(params, AutoscalingParams):
        raise ValueError(f"Autoscaling-v0 needs AutoscalingParams, got {type(params).__name__}")
    common.validate_params(params.serving, queue_buffer, max_batch, max_replicas,
                           where="params.serving")
    for f, dtype in SCALING_FIELDS.items():
        raw = numeric_array(getattr(params, f), f"params.{f}")
        if dtype == jnp.int32 and raw.dtype.kind not in "iu":
            check_int_array(raw, f"params.{f}", -2 ** 31, 2 ** 31 - 1)
        v = raw.astype(np.float64)
        if not np.all(np.isfinite(v)) or np.any(v < 0):
            raise ValueError(f"params.{f} must be finite and >= 0, got {v}")
        # Times, prices and weights at most MAX_SECONDS (the price spread at most 1e3): the
        # interval's cost stays far inside float32 (module constants in `core.types`).
        high = 1e3 if f == "price_spread" else MAX_SECONDS
        if dtype == jnp.float32 and np.any(v > high):
            raise ValueError(f"params.{f} must be <= {high:g}, got {v}")
    for f in ("control_interval_s", "diurnal_period_s"):
        if np.any(np.asarray(getattr(params, f)) <= 0):
            raise ValueError(f"params.{f} must be > 0, got {np.asarray(getattr(params, f))}")
    if np.any(np.asarray(params.diurnal_amplitude) >= 1):
        raise ValueError(f"params.diurnal_amplitude must be in [0, 1), got "
                         f"{np.asarray(params.diurnal_amplitude)}")
    if np.any(np.asarray(params.price_spread) < 1):
        raise ValueError(f"params.price_spread must be >= 1, got {np.asarray(params.price_spread)}")
    for f in ("random_phase", "random_initial", "random_offset"):
        if not np.all(np.isin(np.asarray(getattr(params, f)), (0, 1))):
            raise ValueError(f"params.{f} must be 0 or 1, got {np.asarray(getattr(params, f))}")
    if not np.all(np.isin(np.asarray(params.action_mode), (TARGET, DELTA))):
        raise ValueError(f"params.action_mode must be 0 (target) or 1 (delta), got "
                         f"{np.asarray(params.action_mode)}")
    n0 = np.asarray(params.initial_replicas)
    if np.any(n0 < 1) or np.any(n0 > max_replicas):
        raise ValueError(f"params.initial_replicas must be in [1, {max_replicas}], got {n0}")
    has_trace = np.asarray(params.serving.trace.length) > 0
    if np.any(has_trace & (np.asarray(params.diurnal_amplitude) > 0)):
        raise ValueError("params.diurnal_amplitude must be 0 when a trace is replayed "
                         "(the trace carries its own time variation)")
    if not np.all(has_trace):
        # The per-interval arrival loop (`Autoscaling.step_env`) spans `control_interval_s`
        # at a rate up to `(1 + diurnal_amplitude) < 2` times the phase rate.
        horizon = 2.0 * float(np.max(np.asarray(params.control_interval_s, np.float64)))
        common.check_arrival_horizon(params.serving.arrivals, horizon,
                                     "params.serving.arrivals", "2 x control_interval_s")


# ---- Autoscaling-v0's defaults and builder (registered in `envs.registry`)

# Autoscaling-v0's defaults: the scaling fields' are `AutoscalingParams`' field defaults;
# these are its serving defaults over `ServingParams`' shared ones (`envs.common`), under a
# named workload's overrides (`envs.autoscaling_workloads`) and the caller's keywords. A
# callable is called per build.
AUTOSCALING_DEFAULTS = dict(
    gpu=lambda: get_profile("mid"),  # every replica slot's profile
    max_replicas=8,
    # req/s, mean of the diurnal cycle, when no arrivals, arrival_rate or trace is given:
    # 4-5 replicas hold the mean latency under the SLO at the mean rate, 7-8 at the peak
    # (amplitude 0.6); docs/scaling.md has the fixed-count measurements.
    arrival_rate=1.2,
    tokens=routing_tokens,
    slo_s=60.0,
    max_steps_in_episode=480,  # 2 h of 15 s intervals (TRACE_EPISODE_STEPS with a trace)
)


# The scenario a learned autoscaler trains on (`agents.defaults.ENV_DEFAULTS["Autoscaling-v0"]
# ["env_overrides"]`; docs/scaling.md, "A learned autoscaler that adapts"): decisions every
# 120 s, one warm-up, so a replica asked for serves before the next decision can cancel it
# (evaluate on the 15 s default with `policies.autoscaling.hold_every(policy, 8)`); step
# actions, so an explored change persists while the policy "stays"; clipped steps cost 200
# request-s, or a step policy ratchets to the maximum for free; a random time of day and
# replica count at reset, so vmapped episodes are not in lockstep and every (time, count) pair
# is visited; a price per episode in [1, 16] (price_spread 4 around 4), seen in the
# observation, so the policy is price-conditioned; latency_scale 10x the registry's (at 1000
# the value loss swamps the actor's gradient after clipping).
AUTOSCALING_TRAINING = dict(action_mode=1, latency_scale=10_000.0, control_interval_s=120.0,
                            max_steps_in_episode=60, random_phase=1, random_initial=1,
                            invalid_penalty_s=200.0, price_spread=4.0)

def scaling_params(serving: common.ServingParams, **scalars) -> AutoscalingParams:
    """`AutoscalingParams` around `serving`: its field defaults under `scalars`, each cast
    to its dtype (`SCALING_FIELDS`)."""
    unknown = set(scalars) - set(SCALING_FIELDS)
    if unknown:
        raise ValueError(f"unknown Autoscaling-v0 parameter(s) {sorted(unknown)}; known: "
                         f"{sorted(SCALING_FIELDS)}")
    values = {**{f.name: f.default for f in dataclasses.fields(AutoscalingParams)
                 if f.name in SCALING_FIELDS}, **scalars}
    return AutoscalingParams(serving=serving, **{
        k: common.scalar_leaf(k, values[k], SCALING_FIELDS[k]) for k in SCALING_FIELDS})


def make_autoscaling(gpu=None, gpus=None, max_replicas=None, queue_buffer=None, arrival_rate=None,
                     arrivals=None, history_len=64, workload="diurnal", load=None, **kw):
    """Autoscaling-v0: up to 8 A100 replicas of Llama-2-70B under a diurnal load.

    `workload` names a trace-based workload instead (`envs.autoscaling_workloads`), at offered
    load `load` of the whole cluster. Defaults: `AUTOSCALING_DEFAULTS` (serving, cluster)
    and `AutoscalingParams`' field defaults (scaling).
    """

    d = AUTOSCALING_DEFAULTS
    if gpu is not None and gpus is not None:
        raise ValueError("give either gpu= (one profile for every slot) or gpus=, not both")
    if gpus is None:
        n = d["max_replicas"] if max_replicas is None else max_replicas
        gpus = [d["gpu"]() if gpu is None else gpu] * as_size("max_replicas", n)
    gpus = list(gpus)
    max_replicas = len(gpus)
    named = workload_overrides(workload, gpus, load)
    if named and (arrivals is not None or arrival_rate is not None or "trace" in kw
                  or "tokens" in kw):
        raise ValueError(f"workload={workload!r} sets the arrivals and tokens itself; do not "
                         f"also pass arrivals, arrival_rate, trace or tokens")
    if "arrivals" in named:
        arrivals = named.pop("arrivals")
    for k, v in named.items():
        kw.setdefault(k, v)
    if kw.get("trace") is not None:
        # One episode replays the whole trace (it terminates when the trace has drained),
        # whether the trace came from a named workload or from `trace=`.
        kw.setdefault("max_steps_in_episode", TRACE_EPISODE_STEPS)
    scalars = {k: kw.pop(k) for k in list(kw) if k in SCALING_FIELDS}
    if "trace" in kw and kw["trace"] is not None:
        scalars.setdefault("diurnal_amplitude", 0.0)
    if arrivals is None and arrival_rate is None and kw.get("trace") is None:
        arrival_rate = d["arrival_rate"]
    if arrivals is None and arrival_rate is None:
        arrival_rate = 1.0  # unused: the trace replaces the arrival process
    # The shared drop penalty (600 s: shedding load must not be a way to save GPUs).
    fill_defaults(kw, d, exclude=("gpu", "max_replicas", "arrival_rate"))
    serving = build_params(gpus, arrivals=arrivals, arrival_rate=arrival_rate, **kw)
    qb, mb = static_sizes(queue_buffer, serving)
    params = scaling_params(serving, **scalars)
    env = Autoscaling(max_replicas=max_replicas, queue_buffer=qb, max_batch=mb,
                         trace_len=serving.trace.gap.shape[0], history_len=history_len,
                         default=params)
    env.check_params(params)
    return env, params
