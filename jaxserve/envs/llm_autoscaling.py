"""LLMAutoscaling-v0: Autoscaling-v0 with continuous-batching LLM replicas.

The same environment class and step as Autoscaling-v0 (`envs.autoscaling.Autoscaling`):
control intervals, warm-up, draining, release at the last completion, the exact GPU-second
integral, the least-queued-work balancer, observation and reward. Only the engine differs:
every replica slot is a continuous-batching replica (`core.continuous`: vLLM-v1 FCFS, paged KV
cache, recompute preemption, chunked prefill), selected with `ENGINE = engines.CONTINUOUS`.

Engine-specific readings:
  - `params.serving.gpus` is a stacked `ReplicaProfile` (one entry per slot).
  - the balancer's and the drain choice's "queued work" is `core.continuous_load.queued_work`
    (estimated seconds, from output estimates); the observation's offered load uses
    `continuous_load.request_work` per arrival.
  - the static running slots per replica are `max_seqs` (`LLMAutoscalingStatic`, named as
    the profile field they bound; Autoscaling-v0's are `max_batch`), and "requests in system
    per serving replica / max_batch" divides by the profiles' `max_seqs`.
  - a draining replica is released at the end of its last iteration (its last completion).
  - requests that can never fit a replica's KV cache are dropped (`StepMetrics.dropped`).

Separate id rather than `Autoscaling-v0(replicas=...)`: the state pytree, the profile type and
the default scenario differ, and a registered id puts it under the shared contract test.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core import engines
from jaxserve.core.replica import ReplicaProfile, replica_profile, stack_replicas
from jaxserve.envs import autoscaling as AS
from jaxserve.envs import common
from jaxserve.envs.autoscaling import scaling_params
from jaxserve.envs.base import as_size, check_sizes
from jaxserve.envs.defaults import (TRACE_EPISODE_STEPS, build_params, fill_defaults,
                                    refuse_gpus, replica_sizes)
from jaxserve.envs.routing import routing_tokens


@dataclasses.dataclass(frozen=True)
class LLMAutoscalingStatic:
    """Static configuration of LLMAutoscaling-v0 (`envs.base.StaticConfig`): Autoscaling-v0's
    (`autoscaling.AutoscalingStatic`) with the running slots named as the profile field they
    bound.

    Attributes:
      max_replicas: replica slots (the action space's size), >= 1.
      queue_buffer: queue slots per replica (>= every `queue_cap`), >= 1.
      max_seqs: static running slots per replica (>= every replica's `max_seqs`), >= 1. Was
        `max_batch` (renamed: one name per quantity, as LLMRouting-v0's).
      trace_len: rows of a replayed trace (0: synthetic arrivals).
      history_len: per-interval records kept in the state, >= 1.
      log_capacity: 0 (continuous-batching replicas keep no request log).
    """

    max_replicas: int
    queue_buffer: int = 64
    max_seqs: int = 64
    trace_len: int = 0
    history_len: int = 64
    log_capacity: int = 0

    def __post_init__(self):
        check_sizes(self, positive=("max_replicas", "history_len"),
                    nonnegative=("trace_len", "log_capacity"),
                    slots=("queue_buffer", "max_seqs"))


class LLMAutoscaling(AS.Autoscaling):
    """Autoscaling-v0 over continuous-batching replicas (module docstring).

    `max_seqs` (static) is the number of running slots per replica: at least the largest
    `max_seqs` of the slots. Actions as Autoscaling-v0's: one that is not
    an integer in `[0, max_replicas)` (out of range, non-integral or non-finite) is counted in
    `info["invalid_actions"]` and mapped by `common.discrete_action` (clipped, floored, NaN
    to 0).
    """

    Static = LLMAutoscalingStatic
    ENGINE = engines.CONTINUOUS

    def __getattr__(self, name):
        if name == "max_batch":  # the old name of the static running slots
            raise AttributeError("LLMAutoscaling-v0's static running slots are max_seqs "
                                 "(renamed from max_batch, as LLMRouting-v0's)")
        return super().__getattr__(name)

    def _running_slots(self) -> int:
        return self.max_seqs

    @property
    def name(self) -> str:
        return "LLMAutoscaling-v0"

    def check_params(self, params: AS.AutoscalingParams) -> None:
        """Raises ValueError (naming the field) if `params` do not fit this environment."""
        if not isinstance(params, AS.AutoscalingParams):
            raise ValueError(f"LLMAutoscaling-v0 needs AutoscalingParams, got "
                             f"{type(params).__name__}")
        prof = params.serving.gpus
        if not isinstance(prof, ReplicaProfile):
            raise ValueError(f"params.serving.gpus must be a stacked ReplicaProfile (core."
                             f"replica.stack_replicas), got {type(prof).__name__}")
        # `validate_params` checks the replicas as ReplicaProfiles (max_seqs within the
        # static running slots `max_seqs`).
        AS.validate_scaling_params(params, self.queue_buffer, self.max_seqs, self.max_replicas)
        common.check_token_headroom(params.serving, prof.block_size, self.max_seqs,
                                    "params.serving")


# ---- LLMAutoscaling-v0's scenario and builder (registered in `envs.registry`)

# LLMAutoscaling-v0's defaults over `ServingParams`' and `AutoscalingParams`' field defaults,
# under the caller's keywords; a callable is called per build.
LLM_AUTOSCALING_DEFAULTS = dict(
    # every replica slot's profile (`max_replicas` of them)
    replica=lambda: replica_profile("opt13b-a100-80g", max_seqs=16, queue_cap=16),
    max_replicas=4,
    arrival_rate=6.0,  # req/s, mean of the diurnal cycle, when no arrivals are given
    tokens=routing_tokens,
    slo_s=20.0,
    max_steps_in_episode=480,  # TRACE_EPISODE_STEPS with a trace
    warmup_s=60.0,
    # Each episode starts at a random time of day, so vmapped episodes are not in lockstep
    # and a policy sees every time of day in every batch (Autoscaling-v0's `random_phase`).
    random_phase=1,
)


def make_llm_autoscaling(replicas=None, max_replicas=None, queue_buffer=None, max_seqs=None,
                         arrival_rate=None, arrivals=None, history_len=64, **kw):
    """LLMAutoscaling-v0: Autoscaling-v0 over continuous-batching LLM replicas.

    `replicas`: list of `ReplicaProfile`, one per slot (default: `max_replicas` OPT-13B
    A100-80GB replicas with `max_seqs = queue_cap = 16`, about 3.4 req/s each on Routing-v0's
    token mix by `core.continuous_load`). Diurnal Poisson arrivals, mean 6 req/s (peak 9.6:
    three replicas at the mean, all four near the peak), each episode from a random time of
    day (`random_phase=1`); warm-up 60 s; `latency_scale=1000` s and `drop_penalty_s=600` s
    as the other environments (`LLM_AUTOSCALING_DEFAULTS`). Other keywords as
    Autoscaling-v0's scaling and serving parameters (`envs/llm_autoscaling.py`).
    """

    refuse_gpus("LLMAutoscaling-v0", kw)
    d = LLM_AUTOSCALING_DEFAULTS
    if replicas is None:
        n = d["max_replicas"] if max_replicas is None else max_replicas
        replicas = [d["replica"]()] * as_size("max_replicas", n)
    replicas = list(replicas)
    prof = stack_replicas(replicas)
    scalars = {k: kw.pop(k) for k in list(kw) if k in AS.SCALING_FIELDS}
    fill_defaults(scalars, {k: v for k, v in d.items() if k in AS.SCALING_FIELDS})
    if kw.get("trace") is not None:
        scalars.setdefault("diurnal_amplitude", 0.0)
    if arrivals is None and arrival_rate is None:
        arrival_rate = d["arrival_rate"]
    # A replayed trace runs to its end (termination), not to the synthetic episode's 480
    # intervals: the trace's default must be set first, or the synthetic one wins.
    if kw.get("trace") is not None:
        kw.setdefault("max_steps_in_episode", TRACE_EPISODE_STEPS)
    fill_defaults(kw, {k: v for k, v in d.items() if k not in AS.SCALING_FIELDS},
                  exclude=("replica", "max_replicas", "arrival_rate"))
    serving = build_params(prof, arrivals=arrivals, arrival_rate=arrival_rate, **kw)
    qb, ms = replica_sizes(prof, queue_buffer, max_seqs)
    params = scaling_params(serving, **scalars)
    env = LLMAutoscaling(max_replicas=len(replicas), queue_buffer=qb, max_seqs=ms,
                         trace_len=serving.trace.gap.shape[0], history_len=history_len,
                         default=params)
    env.check_params(params)
    return env, params
