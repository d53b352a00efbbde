"""Routing-v0: route each arriving request to one GPU of a heterogeneous cluster."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import environment, spaces

from jaxserve.core import cluster as C
from jaxserve.core.metrics import StepMetrics
from jaxserve.core.queues import Request
from jaxserve.core.service import single_request_time
from jaxserve.envs import common

NUM_REQUEST_FEATURES = 3
NUM_GPU_FEATURES = 6
FEATURE_CLIP = 1e3  # keeps time features finite and inside the observation space at any load


@struct.dataclass
class RoutingState:
    """State of a Routing-v0 episode; times relative to the pending request's arrival (t = 0).

    Attributes:
      cluster: queues and running batches of every GPU.
      pending: the request awaiting its routing decision.
      phase: arrival-process phase. int32.
      trace_pos: trace row of the pending request. int32.
      time: decisions taken this episode (gymnax's step counter). int32.
      log: per-request schedule of the episode's first `log_capacity` requests (empty unless
        the environment was built with a log, as `replay` and `evaluate` do).
    """

    cluster: C.Cluster
    pending: Request
    phase: jax.Array
    trace_pos: jax.Array
    time: jax.Array
    log: C.RequestLog


class Routing(common.StaticConfig, environment.Environment[RoutingState, common.ServingParams]):
    """Route every arriving request to a GPU; each GPU runs the static batcher.

    Decision epochs: each request arrival (one decision per request). Between arrivals the
    cluster evolves exactly (event-driven) under the static batcher of each GPU.

    Observation: float32 `(3 + num_gpus * 6,)`, features in [0, 1000]:
      - `[0:3]` the arriving request: `log1p(prompt)/log1p(max_prompt)`,
        `log1p(estimate)/log1p(max_output)`, size class / (classes - 1). The estimate is the true
        output length, a noisy one or the class's representative, per `estimate_mode`.
      - `[3:]` one row of 6 per GPU (row-major `(num_gpus, 6)`): waiting / queue_cap,
        running / max_batch, time until the running batch ends / time_scale,
        queued work / time_scale (`cluster.queued_work`, from estimates), relative speed
        (fastest GPU's time for a reference request / this GPU's, in (0, 1]), and the mean output
        estimate of the GPU's requests (waiting + running), `log1p(mean)/log1p(max_output)`:
        where long requests sit, i.e. where a short one would be blocked behind them.
      `obs_layout` gives `(3, num_gpus, 6)` for networks that reshape it.
    Action: `Discrete(num_gpus)`, the GPU index. Out-of-range actions are clipped to
      `[0, num_gpus)` and counted in `info["invalid_actions"]`.
    Reward: `-(time-in-system during the step + drop_penalty_s * drops) / latency_scale`;
      see `common.reward_from`.
    Termination: only with a replayed trace, after its last request (the step then drains the
      cluster, so the return counts every request's whole latency). Truncation after
      `max_steps_in_episode` decisions.
    State: `RoutingState`.
    """

    STATIC_FIELDS = ("num_gpus", "queue_buffer", "max_batch", "trace_len", "log_capacity")

    def __init__(self, num_gpus: int, queue_buffer: int = 64, max_batch: int = 16,
                 trace_len: int = 0, default: common.ServingParams | None = None,
                 log_capacity: int = 0):
        super().__init__()
        if num_gpus < 1:
            raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
        if queue_buffer < 1:
            raise ValueError(f"queue_buffer must be >= 1, got {queue_buffer}")
        self.num_gpus = int(num_gpus)
        self.queue_buffer = int(queue_buffer)
        self.max_batch = int(max_batch)
        self.trace_len = int(trace_len)
        self.log_capacity = int(log_capacity)
        self._default = default

    @property
    def name(self) -> str:
        return "Routing-v0"

    @property
    def num_actions(self) -> int:
        return self.num_gpus

    @property
    def obs_layout(self) -> tuple[int, int, int]:
        """(request features, GPUs, features per GPU) of the flat observation."""
        return NUM_REQUEST_FEATURES, self.num_gpus, NUM_GPU_FEATURES

    def reset_env(self, key, params):
        k_phase, k_req = jax.random.split(key)
        phase = common.first_phase(k_phase, params)
        _, req, phase, _ = common.next_arrival(k_req, params, phase, jnp.int32(0), jnp.int32(0))
        state = RoutingState(cluster=C.empty_cluster(
                                 self.num_gpus, self.queue_buffer, self.max_batch,
                                 with_ids=self.log_capacity > 0),
                             pending=req, phase=phase, trace_pos=jnp.int32(0),
                             time=jnp.int32(0), log=C.empty_log(self.log_capacity))
        return self.get_obs(state, params), state

    def step_env(self, key, state, action, params):
        action = jnp.asarray(action, jnp.int32)
        invalid = (action < 0) | (action >= self.num_gpus)
        gpu = jnp.clip(action, 0, self.num_gpus - 1)
        cluster, dropped = C.route(state.cluster, params.gpus, state.pending, gpu)
        nxt_pos = state.trace_pos + 1
        gap, req, phase, exhausted = common.next_arrival(
            key, params, state.phase, nxt_pos, state.pending.req_id + 1)
        cluster, metrics, log = C.advance_static(cluster, params.gpus, gap, params.slo_s,
                                                 state.log)
        # A drained cluster (gap = inf) has no times left to keep precise; skip the rebase.
        cluster = C.rebase(cluster, jnp.where(exhausted, 0.0, gap))
        metrics = metrics.replace(arrived=jnp.int32(1), dropped=dropped.astype(jnp.int32),
                                  invalid_actions=invalid.astype(jnp.int32))
        state = RoutingState(cluster=cluster, pending=req, phase=phase, trace_pos=nxt_pos,
                             time=state.time + 1, log=log)
        reward = common.reward_from(metrics, params)
        return self.get_obs(state, params), state, reward, exhausted, metrics.as_dict()

    def get_obs(self, state, params=None, key=None):
        return routing_observation(state.cluster, state.pending, params)

    def is_terminated(self, state, params):
        tr = params.trace
        return jnp.bool_(tr.gap.shape[0] > 0) & (state.trace_pos >= tr.length)

    def action_space(self, params=None):
        return spaces.Discrete(self.num_gpus)

    def observation_space(self, params=None):
        n = NUM_REQUEST_FEATURES + self.num_gpus * NUM_GPU_FEATURES
        return spaces.Box(0.0, FEATURE_CLIP, (n,), jnp.float32)

    def state_space(self, params=None) -> Any:
        raise NotImplementedError("Routing-v0 exposes its state as the RoutingState pytree")


def gpu_features(cluster: C.Cluster, params: common.ServingParams) -> jax.Array:
    """The per-GPU observation rows, `(num_gpus, 6)`; see `Routing`'s docstring."""
    gpus, q, s = params.gpus, cluster.queues, cluster.servers
    ts = params.time_scale
    ref = single_request_time(gpus, 512.0, 128.0)
    waiting = q.count.astype(jnp.float32)
    running = s.run_count.astype(jnp.float32)
    mean_estimate = (q.estimate_sum + s.run_estimate) / jnp.maximum(waiting + running, 1.0)
    rows = jnp.stack([
        waiting / jnp.maximum(gpus.queue_cap, 1),
        running / jnp.maximum(gpus.max_batch, 1),
        jnp.where(s.run_count > 0, jnp.maximum(s.free_at, 0.0), 0.0) / ts,
        C.queued_work(cluster, gpus) / ts,
        ref.min() / ref,
        jnp.log1p(mean_estimate) / jnp.log1p(params.tokens.max_output),
    ], axis=-1)
    return jnp.clip(jnp.nan_to_num(rows), 0.0, FEATURE_CLIP).astype(jnp.float32)


def routing_observation(cluster: C.Cluster, pending: Request, params) -> jax.Array:
    """Flat Routing-v0 observation: request features then GPU rows."""
    return jnp.concatenate([common.request_features(pending, params),
                            gpu_features(cluster, params).ravel()])
