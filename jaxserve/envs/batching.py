"""Batching-v0: decide when, and how many, waiting requests a single GPU serves together."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import environment, spaces

from jaxserve.core import arrivals as A
from jaxserve.core import cluster as C
from jaxserve.core import engines
from jaxserve.core import queues as Q
from jaxserve.core import rng
from jaxserve.core.lanes import compacted_while
from jaxserve.core.metrics import StepMetrics
from jaxserve.core.profiles import get_profile
from jaxserve.core.tree import select
from jaxserve.envs import common
from jaxserve.envs.base import StaticConfig, check_sizes, clip_features, feature_box
from jaxserve.envs.defaults import build_params, fill_defaults, static_sizes

NUM_FEATURES = 6


@struct.dataclass
class BatchingState:
    """State of a Batching-v0 episode at a decision instant (t = 0: GPU idle, queue non-empty).

    Attributes:
      cluster: the one GPU's queue and batch (num_gpus = 1).
      upcoming: the next request to arrive; its `arrival` is when (s, relative; inf if none).
      phase: arrival-process phase. int32.
      trace_pos: trace row of `upcoming`. int32.
      time: decisions taken this episode. int32.
      log: per-request schedule of the first `log_capacity` requests (see `Routing`).
      reset_arrived, reset_dropped: requests that arrived (and of them, were dropped) during
        `reset`'s run to the first decision, not yet in any `info`: the next step adds them
        to its `info["arrived"]` and `info["dropped"]`, then sets both to 0. int32.
    """

    cluster: C.Cluster
    upcoming: Q.Request
    phase: jax.Array
    trace_pos: jax.Array
    time: jax.Array
    log: C.RequestLog
    reset_arrived: jax.Array
    reset_dropped: jax.Array


@dataclasses.dataclass(frozen=True)
class BatchingStatic:
    """Static configuration of Batching-v0 (`envs.base.StaticConfig`).

    Attributes:
      max_batch: the largest batch (the action space is `Discrete(max_batch + 1)`), >= 1.
      queue_buffer: queue slots (>= `params.gpus.queue_cap`), >= 1.
      trace_len: rows of a replayed trace (0: synthetic arrivals).
      log_capacity: requests kept in the per-request log (0: no log).
    """

    max_batch: int
    queue_buffer: int = 64
    trace_len: int = 0
    log_capacity: int = 0

    def __post_init__(self):
        check_sizes(self, nonnegative=("trace_len", "log_capacity"),
                    slots=("max_batch", "queue_buffer"))


class Batching(StaticConfig, environment.Environment[BatchingState, common.ServingParams]):
    """One GPU; the agent replaces the static batcher.

    Decision epochs: whenever the GPU is idle and requests wait, after every completion and
    arrival at that instant has been processed (MODEL.md's event order).
    Action: `Discrete(max_batch + 1)`. `0` waits: the next decision comes at the next arrival
      instant. `k >= 1` dispatches the first `min(k, waiting, max_batch)` waiting requests as one
      batch now. Counted in `info["invalid_actions"]` and mapped deterministically: an action
      that is not an integer in `[0, max_batch]` is clipped into it (`common.discrete_action`:
      a non-integral or non-finite float is floored, NaN to 0); `k > waiting` dispatches all
      that wait;
      `0` when no request will ever arrive again (end of a trace) dispatches
      `min(waiting, max_batch)`.
    Observation: float32 `(6,)`: waiting / max_batch, waiting / queue_cap, head's wait /
      time_scale, mean wait / time_scale, queued work / time_scale, and the waiting requests'
      mean output estimate as `log1p(mean)/log1p(max_output)`.
    Reward: `-(time-in-system during the step + drop_penalty_s * drops) / latency_scale`.
    Info: the step's `StepMetrics`. `reset` already admits the first arrival (and any others
      at that instant: the first decision needs a waiting request); the first step's
      `info["arrived"]` and `info["dropped"]` include those (`BatchingState.reset_arrived`),
      so that over an episode the summed `arrived` = summed `completed` + summed `dropped` +
      requests in the system. Its reward does not charge reset's drops (no action could have
      avoided them).
    Termination: with a replayed trace, once it has ended and the GPU has drained.
      Truncation after `max_steps_in_episode` decisions.
    """

    policy_kind = "batching"  # registered policies that act here (envs.base)
    Static = BatchingStatic  # static configuration (`env.static`; fields read as attributes)
    # Reset admits the first arrival into the queue: an auto-reset must keep those slots
    # (`StaticConfig.step`), or the new episode's first request is the old one's slot 0.
    reset_fills_queues = True
    num_gpus = 1

    @property
    def name(self) -> str:
        return "Batching-v0"

    @property
    def num_actions(self) -> int:
        return self.max_batch + 1

    def check_params(self, params) -> None:
        """Raises ValueError (naming the field) if `params` do not fit this environment, or if
        synthetic arrivals are too fast for float32 time over one batch's longest service
        (`common.check_arrival_horizon`; see `_run_to_decision`)."""
        super().check_params(params)
        if int(np.asarray(params.trace.length)) == 0:
            horizon = float(np.max(common.static_service_bound(params.gpus, params.tokens)))
            common.check_arrival_horizon(params.arrivals, horizon, "params.arrivals",
                                         "one batch's longest service time (params.gpus, "
                                         "params.tokens.max_prompt/max_output)")

    def reset_env(self, key, params):
        k_phase, k_req, k_run = rng.split(key, 3)
        phase = common.first_phase(k_phase, params)
        gap, req, phase, _ = common.next_arrival(k_req, params, phase, jnp.int32(0), jnp.int32(0))
        state = BatchingState(cluster=C.empty_cluster(1, self.queue_buffer, self.max_batch,
                                                      with_ids=self.log_capacity > 0),
                              upcoming=req.replace(arrival=jnp.float32(0.0)), phase=phase,
                              trace_pos=jnp.int32(0), time=jnp.int32(0),
                              log=C.empty_log(self.log_capacity),
                              reset_arrived=jnp.int32(0), reset_dropped=jnp.int32(0))
        state, m = self._run_to_decision(k_run, state, params, jnp.bool_(False))
        state = state.replace(reset_arrived=m.arrived, reset_dropped=m.dropped)
        return self.get_obs(state, params), state

    def step_env(self, key, state, action, params):
        action, bad = common.discrete_action(action, self.max_batch + 1)
        cl = state.cluster
        waiting = cl.queues.count[0]
        limit = C.batch_limit(cl, params.gpus)[0]
        no_more = ~jnp.isfinite(state.upcoming.arrival)
        k = jnp.minimum(action, jnp.minimum(waiting, limit))
        forced = (k == 0) & no_more
        k = jnp.where(forced, jnp.minimum(waiting, limit), k)
        invalid = bad | (action > waiting) | forced
        go = (k > 0) & (waiting > 0)
        cl, log = C.dispatch(cl, params.gpus, go[None], k[None], jnp.zeros((1,), jnp.float32),
                             params.slo_s, state.log)
        state = state.replace(cluster=cl, log=log)
        at_reset = (state.reset_arrived, state.reset_dropped)
        state, metrics = self._run_to_decision(key, state, params, ~go)
        metrics = metrics.replace(invalid_actions=invalid.astype(jnp.int32))
        state = state.replace(time=state.time + 1, reset_arrived=jnp.int32(0),
                              reset_dropped=jnp.int32(0))
        reward = common.reward_from(metrics, params)
        # Reported, not charged: the reset's arrivals and drops (class docstring, Info).
        metrics = metrics.replace(arrived=metrics.arrived + at_reset[0],
                                  dropped=metrics.dropped + at_reset[1])
        return (self.get_obs(state, params), state, reward, self.is_terminated(state, params),
                metrics.as_dict())

    def _run_to_decision(self, key, state, params, must_wait):
        """Processes completions and arrivals until the next decision instant; rebases to it.

        Stops when the GPU is idle, requests wait, no arrival is due at this very instant and
        the agent did not just choose to wait (`must_wait`, cleared by the next arrival); or
        when nothing can happen any more (trace ended, system empty).
        """
        def ready(c):
            cl, nxt, _, _, t, must, _, _ = c
            idle = cl.servers.run_count[0] == 0
            q = cl.queues.count[0]
            decide = idle & (q > 0) & (nxt.arrival > t) & ~must
            finished = idle & (q == 0) & ~jnp.isfinite(nxt.arrival)
            return decide | finished

        def body(c, params, active):
            cl, nxt, phase, pos, t, must, m, key = c
            key, k_next = rng.split(key)
            s = cl.servers
            completion = (s.run_count[0] > 0) & (s.free_at[0] <= nxt.arrival)
            t_new = jnp.where(completion, s.free_at[0], nxt.arrival)
            m = m.replace(in_system_time=m.in_system_time + C.in_system(cl) * (t_new - t))
            cl_done, m_done = C.complete_due(cl, completion[None], m)
            # Gated (`lanes.compacted_while`): only an active lane's arrival writes a queue
            # slot, so the slot buffers skip the selects below (a copy of each per iteration).
            cl_arr, dropped = C.route(cl, params.gpus, nxt, jnp.int32(0), active & ~completion)
            m_arr = m.replace(arrived=m.arrived + 1, dropped=m.dropped + dropped)
            gap, req, phase_arr, _ = common.next_arrival(k_next, params, phase, pos + 1,
                                                         nxt.req_id + 1)
            nxt_arr = req.replace(arrival=t_new + gap)
            cl_new, m = select(completion, (cl_done, m_done), (cl_arr, m_arr))
            nxt, phase, pos = select(completion, (nxt, phase, pos), (nxt_arr, phase_arr, pos + 1))
            out = select(active, (cl_new, nxt, phase, pos, t_new, must & completion, m, key), c)
            return (engines.STATIC.with_buffers(out[0], cl_arr), *out[1:])

        # Why the loop ends. Each iteration is a completion or an arrival. One GPU runs one
        # batch, so at most one completion happens per call; after it the loop ends at the
        # first arrival whose time is > t (or at once if requests wait and none is due).
        # With a trace every arrival consumes a row (`pos + 1`) and an exhausted trace's gap
        # is inf, so there are at most `trace_len + 1` iterations. With synthetic arrivals,
        # `t` stays below one batch's longest service time H (`common.static_service_bound`)
        # plus the gap to the first arrival after it, and `check_params` bounds every phase
        # rate by `r * H <= 2^23` (`common.check_arrival_horizon`): each gap then moves the
        # float32 clock with probability > 0.36, so the loop ends after about `r * H` arrivals
        # and never spins on `t + gap == t` (as `arrival_rate=1e30` would).
        carry = (state.cluster, state.upcoming, state.phase, state.trace_pos, jnp.float32(0.0),
                 must_wait, StepMetrics.zeros(), key)
        # Under vmap the lanes' iteration counts are skewed (the arrivals during one batch's
        # service: ~7 on average, 30+ for a few lanes), so the loop compacts its lanes.
        cl, nxt, phase, pos, t, _, m, _ = compacted_while(lambda c, _: ~ready(c), body, carry,
                                                          params, gated=True)
        # Busy time of this window: the batch started at 0 (if any) up to min(end, t).
        s = cl.servers
        busy_open = jnp.where(s.run_count > 0, t - jnp.maximum(s.run_start, 0.0), 0.0).sum()
        m = m.replace(busy_time=m.busy_time + busy_open, elapsed=t)
        state = state.replace(cluster=C.rebase(cl, t), upcoming=nxt.replace(arrival=nxt.arrival - t),
                              phase=phase, trace_pos=pos)
        return state, m

    def get_obs(self, state, params=None, key=None):
        q = state.cluster.queues
        p = params
        waiting = q.count[0].astype(jnp.float32)
        mask = Q.waiting_mask(q)[0]
        # Relative arrivals are the stored ones plus the row's offset (`queues.shift`).
        wait = jnp.where(mask, -Q.arrival_times(q)[0], 0.0)
        mean_estimate = q.estimate_sum[0] / jnp.maximum(waiting, 1.0)
        feats = jnp.stack([
            waiting / jnp.maximum(p.gpus.max_batch[0], 1),
            waiting / jnp.maximum(p.gpus.queue_cap[0], 1),
            wait.max() / p.time_scale,
            wait.sum() / jnp.maximum(waiting, 1.0) / p.time_scale,
            C.queued_work(state.cluster, p.gpus)[0] / p.time_scale,
            jnp.log1p(mean_estimate) / jnp.log1p(p.tokens.max_output),
        ])
        return clip_features(feats)

    def is_terminated(self, state, params):
        cl = state.cluster
        return ((cl.servers.run_count[0] == 0) & (cl.queues.count[0] == 0)
                & ~jnp.isfinite(state.upcoming.arrival))

    def action_space(self, params=None):
        return spaces.Discrete(self.max_batch + 1)

    def observation_space(self, params=None):
        return feature_box((NUM_FEATURES,))

    def state_space(self, params=None) -> Any:
        raise NotImplementedError("Batching-v0 exposes its state as the BatchingState pytree")


# ---- Batching-v0's defaults and builder (registered in `envs.registry`)

# Batching-v0's defaults over `ServingParams`' shared field defaults (`envs.common`: SLO 10 s,
# size-class estimates, 512 decisions, the shared reward scales), under the caller's
# keywords. A callable is called per build.
BATCHING_DEFAULTS = dict(
    gpus=lambda: [get_profile("mid")],
    # req/s, when neither arrivals= nor arrival_rate= is given: a full batch of 16 takes
    # ~33 s on this replica (at most ~0.48 req/s), so load ~0.7.
    arrival_rate=0.35,
    tokens=A.bimodal_tokens,
)


def make_batching(gpus=None, queue_buffer=None, arrival_rate=None, arrivals=None, **kw):
    """Batching-v0: one GPU, Poisson arrivals, the agent decides each batch
    (`BATCHING_DEFAULTS` under the keywords)."""
    gpus = BATCHING_DEFAULTS["gpus"]() if gpus is None else list(gpus)
    if len(gpus) != 1:
        raise ValueError(f"Batching-v0 runs exactly one GPU, got {len(gpus)}")
    if arrivals is None and arrival_rate is None:
        arrival_rate = BATCHING_DEFAULTS["arrival_rate"]
    fill_defaults(kw, BATCHING_DEFAULTS, exclude=("gpus", "arrival_rate"))
    params = build_params(gpus, arrivals=arrivals, arrival_rate=arrival_rate, **kw)
    qb, mb = static_sizes(queue_buffer, params)
    env = Batching(max_batch=mb, queue_buffer=qb,
                   trace_len=params.trace.gap.shape[0], default=params)
    env.check_params(params)
    return env, params
