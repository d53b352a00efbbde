"""Per-step metric accumulators reported in `info` and summed by the evaluation harness."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class StepMetrics:
    """What happened during one environment step (one window of simulated time).

    Attributes:
      arrived: requests that arrived. int32.
      completed: requests whose batch finished. int32.
      dropped: requests refused by a full queue. int32.
      latency_sum: summed latency of the completed requests (s). float32.
      slo_met: completed requests whose latency was <= the SLO. int32.
      busy_time: GPU-seconds spent serving batches, summed over GPUs (s). float32.
      in_system_time: integral over the window of the number of requests in the system
        (waiting plus running), in request-seconds; its sum over an episode is the episode's
        total time-in-system. float32.
      elapsed: simulated seconds the window spans. float32.
      invalid_actions: actions that were out of range or infeasible and were mapped to a valid
        one (documented per environment). int32.
    """

    arrived: jax.Array
    completed: jax.Array
    dropped: jax.Array
    latency_sum: jax.Array
    slo_met: jax.Array
    busy_time: jax.Array
    in_system_time: jax.Array
    elapsed: jax.Array
    invalid_actions: jax.Array

    @classmethod
    def zeros(cls) -> "StepMetrics":
        i, f = jnp.int32(0), jnp.float32(0.0)
        return cls(arrived=i, completed=i, dropped=i, latency_sum=f, slo_met=i, busy_time=f,
                   in_system_time=f, elapsed=f, invalid_actions=i)

    def __add__(self, other: "StepMetrics") -> "StepMetrics":
        return jax.tree.map(jnp.add, self, other)

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}
