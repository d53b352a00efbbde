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
  - "requests in system per serving replica / max_batch" divides by `max_seqs`.
  - a draining replica is released at the end of its last iteration (its last completion).
  - requests that can never fit a replica's KV cache are dropped (`StepMetrics.dropped`).

Separate id rather than `Autoscaling-v0(replicas=...)`: the state pytree, the profile type and
the default scenario differ, and a registered id puts it under the shared contract test.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.core import engines
from jaxserve.core.replica import validate_replica
from jaxserve.core.types import GPUProfile
from jaxserve.envs import autoscaling as AS
from jaxserve.envs import common


class LLMAutoscaling(AS.Autoscaling):
    """Autoscaling-v0 over continuous-batching replicas (module docstring).

    `max_batch` (a static size of the parent) is the number of running slots per replica:
    at least the largest `max_seqs` of the slots. Actions as Autoscaling-v0's: one that is not
    an integer in `[0, max_replicas)` (out of range, non-integral or non-finite) is counted in
    `info["invalid_actions"]` and mapped by `common.discrete_action` (clipped, floored, NaN
    to 0).
    """

    ENGINE = engines.CONTINUOUS

    @property
    def name(self) -> str:
        return "LLMAutoscaling-v0"

    def check_params(self, params: AS.AutoscalingParams) -> None:
        """Raises ValueError (naming the field) if `params` do not fit this environment."""
        if not isinstance(params, AS.AutoscalingParams):
            raise ValueError(f"LLMAutoscaling-v0 needs AutoscalingParams, got "
                             f"{type(params).__name__}")
        prof = params.serving.gpus
        validate_replica(prof, where="params.serving.gpus")
        shape = np.shape(prof.c0)
        if shape[-1:] != (self.max_replicas,):
            raise ValueError(f"params.serving.gpus has {shape[-1:] or 'no'} replicas; the "
                             f"environment has {self.max_replicas} slots")
        if np.any(np.asarray(prof.max_seqs) > self.max_batch):
            raise ValueError(f"params.serving.gpus.max_seqs {np.asarray(prof.max_seqs)} exceeds "
                             f"the static running slots ({self.max_batch})")
        # The shared validator checks the rest, given a stand-in GPU profile with the
        # replicas' queue caps (as LLMRouting-v0 does).
        ones = jnp.ones(shape, jnp.float32)
        stand_in = GPUProfile(c0=ones, alpha=ones, alpha2=ones, beta=ones, gamma=ones,
                              delta=ones, max_batch=jnp.ones(shape, jnp.int32),
                              queue_cap=jnp.asarray(prof.queue_cap, jnp.int32), timeout=ones)
        AS.validate_scaling_params(params.replace(serving=params.serving.replace(gpus=stand_in)),
                                   self.queue_buffer, self.max_batch, self.max_replicas)
        common.check_token_headroom(params.serving, prof.block_size, self.max_batch,
                                    "params.serving")
