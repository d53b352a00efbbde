"""LLMRouting-v0: route each arriving request to one continuous-batching LLM replica."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import environment, spaces

from jaxserve.core import continuous as CB
from jaxserve.core import rng
from jaxserve.core.queues import Request
from jaxserve.core.replica import ReplicaProfile, validate_replica
from jaxserve.core.types import GPUProfile
from jaxserve.envs import common
from jaxserve.envs.base import StaticConfig, check_sizes, clip_features, feature_box

NUM_REQUEST_FEATURES = 3
NUM_REPLICA_FEATURES = 7


@struct.dataclass
class LLMRoutingState:
    """State of an LLMRouting-v0 episode; times relative to the pending request's arrival.

    Attributes:
      cluster: waiting queues, running sets and iteration clocks of every replica
        (`continuous.Replicas`).
      pending: the request awaiting its routing decision.
      phase: arrival-process phase. int32.
      trace_pos: trace row of the pending request. int32.
      time: decisions taken this episode (gymnax's step counter). int32.
      log: per-request outcome of the episode's first `log_capacity` requests
        (`continuous.TokenLog`; empty unless built with a log, as `replay` does).
    """

    cluster: CB.Replicas
    pending: Request
    phase: jax.Array
    trace_pos: jax.Array
    time: jax.Array
    log: CB.TokenLog


@dataclasses.dataclass(frozen=True)
class LLMRoutingStatic:
    """Static configuration of LLMRouting-v0 (`envs.base.StaticConfig`).

    Attributes:
      num_replicas: replicas (the action space's size), >= 1.
      queue_buffer: waiting-queue slots per replica (>= every `queue_cap`), >= 1.
      max_seqs: running-sequence slots per replica (>= every profile's `max_seqs`), >= 1.
      trace_len: rows of a replayed trace (0: synthetic arrivals).
      log_capacity: requests kept in the per-request token log (0: no log).
    """

    num_replicas: int
    queue_buffer: int = 64
    max_seqs: int = 64
    trace_len: int = 0
    log_capacity: int = 0

    def __post_init__(self):
        check_sizes(self, positive=("num_replicas", "queue_buffer", "max_seqs"),
                    nonnegative=("trace_len", "log_capacity"))


class LLMRouting(StaticConfig, environment.Environment[LLMRoutingState, common.ServingParams]):
    """Route every arriving request to a replica; each replica batches continuously (vLLM v1).

    `params.gpus` holds the stacked `ReplicaProfile` of the replicas (`stack_replicas`).

    Decision epochs: each request arrival. Between arrivals the replicas evolve exactly
    (event-driven, `core.continuous`).

    Observation: float32 `(3 + num_replicas * 7,)`, features in [0, 1000]:
      - `[0:3]` the arriving request, as in Routing-v0 (`common.request_features`).
      - one row of 7 per replica (row-major): waiting / queue_cap, running / max_seqs,
        KV blocks held / kv_blocks, estimated tokens in flight (prompt + output estimate of
        every request, less tokens already generated) / (kv_blocks * block_size), time until
        the current iteration ends / time_scale, preempted requests waiting / max_seqs, and
        relative speed (fastest replica's iteration time for a reference prefill of 512 tokens
        plus 32 decodes / this replica's, in (0, 1]).
    Action: `Discrete(num_replicas)`. An action that is not an integer in `[0, num_replicas)`
      (out of range, non-integral or non-finite) is counted in `info["invalid_actions"]` and
      mapped deterministically (`common.discrete_action`: clipped into range, a float
      floored, NaN to 0).
    Reward: `-(time-in-system during the step + drop_penalty_s * drops) / latency_scale`
      (`common.reward_from`).
    Termination: only with a replayed trace, after its last request (that step drains the
      replicas). Truncation after `max_steps_in_episode` decisions.
    Info: `StepMetrics` fields (`slo_met` counts completions with end-to-end latency <= slo_s)
      plus `first_tokens`, `ttft_sum` (s), `preemptions` and `never_fit` drops of the step.
    """

    Static = LLMRoutingStatic  # static configuration (`env.static`; fields read as attributes)

    @property
    def num_gpus(self) -> int:
        """Alias of `num_replicas` (what routing helpers and `replay` read)."""
        return self.num_replicas

    @property
    def name(self) -> str:
        return "LLMRouting-v0"

    @property
    def num_actions(self) -> int:
        return self.num_replicas

    @property
    def obs_layout(self) -> tuple[int, int, int]:
        return NUM_REQUEST_FEATURES, self.num_replicas, NUM_REPLICA_FEATURES

    def check_params(self, params: common.ServingParams) -> None:
        """Raises ValueError (naming the field) if `params` do not fit this environment."""
        check_llm_params(params, self.num_replicas, self.queue_buffer, self.max_seqs)

    def reset_env(self, key, params):
        k_phase, k_req = rng.split(key)
        phase = common.first_phase(k_phase, params)
        _, req, phase, _ = common.next_arrival(k_req, params, phase, jnp.int32(0), jnp.int32(0))
        state = LLMRoutingState(
            cluster=CB.empty_replicas(self.num_replicas, self.queue_buffer, self.max_seqs,
                                      with_ids=self.log_capacity > 0),
            pending=req, phase=phase, trace_pos=jnp.int32(0), time=jnp.int32(0),
            log=CB.empty_log(self.log_capacity))
        return self.get_obs(state, params), state

    def step_env(self, key, state, action, params):
        replica, invalid = common.discrete_action(action, self.num_replicas)
        cluster, dropped, never = CB.route(state.cluster, params.gpus, state.pending, replica)
        nxt_pos = state.trace_pos + 1
        gap, req, phase, exhausted = common.next_arrival(
            key, params, state.phase, nxt_pos, state.pending.req_id + 1)
        cluster, metrics, extra, log = CB.advance(cluster, params.gpus, gap, params.slo_s,
                                                  state.log)
        cluster = CB.rebase(cluster, jnp.where(exhausted, 0.0, gap))
        metrics = metrics.replace(arrived=jnp.int32(1), dropped=dropped.astype(jnp.int32),
                                  invalid_actions=invalid.astype(jnp.int32))
        extra = {**extra, "never_fit": never.astype(jnp.int32)}
        state = LLMRoutingState(cluster=cluster, pending=req, phase=phase, trace_pos=nxt_pos,
                                time=state.time + 1, log=log)
        reward = common.reward_from(metrics, params)
        return self.get_obs(state, params), state, reward, exhausted, {**metrics.as_dict(),
                                                                       **extra}

    def get_obs(self, state, params=None, key=None):
        return jnp.concatenate([common.request_features(state.pending, params),
                                replica_features(state.cluster, params).ravel()])

    def is_terminated(self, state, params):
        tr = params.trace
        return jnp.bool_(tr.gap.shape[0] > 0) & (state.trace_pos >= tr.length)

    def action_space(self, params=None):
        return spaces.Discrete(self.num_replicas)

    def observation_space(self, params=None):
        n = NUM_REQUEST_FEATURES + self.num_replicas * NUM_REPLICA_FEATURES
        return feature_box((n,))

    def state_space(self, params=None) -> Any:
        raise NotImplementedError("LLMRouting-v0 exposes its state as the LLMRoutingState pytree")


def reference_iteration_time(prof: ReplicaProfile) -> jax.Array:
    """Seconds a replica needs for a 512-token prefill plus 32 single-sequence decodes."""
    prefill = prof.c0 + prof.alpha * 512.0 + prof.alpha2 * 512.0 * 512.0
    decode = prof.c0 + prof.alpha + prof.beta + prof.gamma + prof.delta * 528.0
    return prefill + 32.0 * decode


def replica_features(rep: CB.Replicas, params: common.ServingParams) -> jax.Array:
    """The per-replica observation rows, `(num_replicas, 7)`; see `LLMRouting`'s docstring."""
    prof = params.gpus
    kv = prof.kv_blocks.astype(jnp.float32)
    ref = reference_iteration_time(prof)
    rows = jnp.stack([
        rep.queues.count / jnp.maximum(prof.queue_cap, 1),
        rep.run.count / jnp.maximum(prof.max_seqs, 1),
        CB.kv_used(rep, prof) / kv,
        CB.tokens_in_flight(rep) / (kv * prof.block_size),
        jnp.where(rep.in_iter, jnp.maximum(rep.t_end, 0.0), 0.0) / params.time_scale,
        rep.q_preempted / jnp.maximum(prof.max_seqs, 1),
        ref.min() / ref,
    ], axis=-1)
    return clip_features(rows)


def check_llm_params(params: common.ServingParams, num_replicas: int, queue_buffer: int,
                     max_seqs: int) -> None:
    """Host-side checks of LLMRouting-v0 params against the environment's static sizes."""
    prof = params.gpus
    validate_replica(prof, where="params.gpus")
    shape = np.shape(prof.c0)
    if shape[-1:] != (num_replicas,):
        raise ValueError(f"params.gpus has {shape[-1:] or 'no'} replicas; the environment has "
                         f"{num_replicas}")
    if np.any(np.asarray(prof.max_seqs) > max_seqs):
        raise ValueError(f"params.gpus.max_seqs {np.asarray(prof.max_seqs)} exceeds the static "
                         f"max_seqs ({max_seqs}); rebuild the environment with a larger one")
    # The rest of ServingParams (arrivals, tokens, scalars) is checked by the shared validator,
    # given a stand-in GPU profile that carries the replicas' queue caps.
    ones = jnp.ones(shape, jnp.float32)
    stand_in = GPUProfile(c0=ones, alpha=ones, alpha2=ones, beta=ones, gamma=ones, delta=ones,
                          max_batch=jnp.ones(shape, jnp.int32),
                          queue_cap=jnp.asarray(prof.queue_cap, jnp.int32), timeout=ones)
    common.validate_params(params.replace(gpus=stand_in), queue_buffer, None, num_replicas)
    common.check_token_headroom(params, prof.block_size, max_seqs)
