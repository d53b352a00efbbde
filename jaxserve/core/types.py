"""Public data types of the engine: GPU profiles and request traces.

Both are `flax.struct.dataclass` pytrees. A `GPUProfile` holds one GPU's numbers as scalars,
or a whole cluster's as `(num_gpus,)` arrays (see `stack_profiles`); either form is a valid
leaf set for `jax.vmap` over parameters. Validation (`validate_*`) runs on the host, outside
jit, and raises `ValueError` naming the offending field.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import struct

PROFILE_FLOAT_FIELDS = ("c0", "alpha", "alpha2", "beta", "gamma", "delta", "timeout")
PROFILE_INT_FIELDS = ("max_batch", "queue_cap")


@struct.dataclass
class GPUProfile:
    """Service model and batcher settings of one GPU (scalars) or a cluster (`(N,)` arrays).

    Service time of a static batch `S` (seconds), per `shared/MODEL.md`:

        T(S) = c0 + alpha * sum p + alpha2 * sum p^2
                  + max o * (beta + gamma * |S| + delta * sum p)

    Attributes:
      c0: fixed overhead per batch (s).
      alpha: prefill cost per prompt token (s/token).
      alpha2: prefill cost per squared prompt token, the attention term (s/token^2).
      beta: cost of one decode iteration (s).
      gamma: extra cost per sequence in the batch per decode iteration (s).
      delta: extra cost per prompt token held in the batch per decode iteration (s/token).
      max_batch: most requests in one batch (B).
      queue_cap: most requests waiting, the running batch not counted (Q).
      timeout: batching timeout of the static batcher (s); 0 is greedy.
      name: label, not a pytree leaf.
    """

    c0: float = 0.05
    alpha: float = 1e-4
    alpha2: float = 0.0
    beta: float = 0.02
    gamma: float = 0.0
    delta: float = 0.0
    max_batch: int = 8
    queue_cap: int = 64
    timeout: float = 0.0
    name: str = struct.field(pytree_node=False, default="custom")


def validate_profile(profile: GPUProfile, where: str = "GPUProfile") -> None:
    """Raises ValueError naming the field if a profile (scalar or stacked) is invalid."""
    for f in PROFILE_FLOAT_FIELDS:
        v = np.asarray(getattr(profile, f), dtype=np.float64)
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{where}.{f} must be finite, got {v}")
        if np.any(v < 0):
            raise ValueError(f"{where}.{f} must be >= 0, got {v}")
    for f in PROFILE_INT_FIELDS:
        v = np.asarray(getattr(profile, f))
        if not np.all(np.isfinite(v)) or np.any(v != np.round(v)):
            raise ValueError(f"{where}.{f} must be an integer, got {v}")
        if np.any(v < 1):
            raise ValueError(f"{where}.{f} must be >= 1, got {v}")


def stack_profiles(profiles: Sequence[GPUProfile]) -> GPUProfile:
    """Stacks per-GPU profiles into one cluster profile with `(num_gpus,)` leaves.

    Floats become float32 and `max_batch`/`queue_cap` int32. Raises ValueError for an empty
    sequence or an invalid profile.
    """
    profiles = list(profiles)
    if len(profiles) == 0:
        raise ValueError("gpus must name at least one GPUProfile (got zero GPUs)")
    for i, p in enumerate(profiles):
        if not isinstance(p, GPUProfile):
            raise ValueError(f"gpus[{i}] must be a GPUProfile, got {type(p).__name__}")
        validate_profile(p, where=f"gpus[{i}]")
    kw = {f: jnp.asarray([float(getattr(p, f)) for p in profiles], jnp.float32)
          for f in PROFILE_FLOAT_FIELDS}
    kw.update({f: jnp.asarray([int(getattr(p, f)) for p in profiles], jnp.int32)
               for f in PROFILE_INT_FIELDS})
    return GPUProfile(name="+".join(p.name for p in profiles), **kw)


@struct.dataclass
class Trace:
    """A request trace: arrival times and token counts, one entry per request.

    Attributes:
      arrival_s: arrival times in seconds, finite, non-decreasing. `(n,)`, float64 on the host.
      prompt_tokens: prompt lengths, integers >= 1. `(n,)`.
      output_tokens: output lengths, integers >= 1. `(n,)`.
    """

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    def __len__(self) -> int:
        return int(np.shape(self.arrival_s)[0])

    def validate(self) -> "Trace":
        """Returns the trace as numpy arrays, or raises ValueError naming the bad field."""
        return validate_trace(self)


def validate_trace(trace: Trace, min_len: int = 1) -> Trace:
    """Checks a trace on the host; returns it with float64/int64 numpy arrays.

    Raises ValueError naming the field for: non-1-D or mismatched lengths, fewer than
    `min_len` rows, NaN/inf or decreasing arrivals, token counts < 1 or non-integer.
    """
    if not isinstance(trace, Trace):
        raise ValueError(f"trace must be a jaxserve.Trace, got {type(trace).__name__}")
    arr = np.asarray(trace.arrival_s, dtype=np.float64)
    fields = {"arrival_s": arr}
    for f in ("prompt_tokens", "output_tokens"):
        v = np.asarray(getattr(trace, f), dtype=np.float64)
        fields[f] = v
    for f, v in fields.items():
        if v.ndim != 1:
            raise ValueError(f"Trace.{f} must be 1-D, got shape {v.shape}")
    n = arr.shape[0]
    for f, v in fields.items():
        if v.shape[0] != n:
            raise ValueError(
                f"Trace.{f} has {v.shape[0]} entries but Trace.arrival_s has {n}")
    if n < min_len:
        raise ValueError(f"Trace.arrival_s must hold at least {min_len} request(s), got {n}")
    for f, v in fields.items():
        if not np.all(np.isfinite(v)):
            bad = int(np.flatnonzero(~np.isfinite(v))[0])
            raise ValueError(f"Trace.{f}[{bad}] is not finite ({v[bad]})")
    if n > 1 and np.any(np.diff(arr) < 0):
        bad = int(np.flatnonzero(np.diff(arr) < 0)[0]) + 1
        raise ValueError(
            f"Trace.arrival_s must be non-decreasing: entry {bad} ({arr[bad]}) < entry "
            f"{bad - 1} ({arr[bad - 1]})")
    for f in ("prompt_tokens", "output_tokens"):
        v = fields[f]
        if np.any(v < 1):
            bad = int(np.flatnonzero(v < 1)[0])
            raise ValueError(f"Trace.{f}[{bad}] must be >= 1, got {v[bad]}")
        if np.any(v != np.round(v)):
            bad = int(np.flatnonzero(v != np.round(v))[0])
            raise ValueError(f"Trace.{f}[{bad}] must be an integer, got {v[bad]}")
    return Trace(arrival_s=arr, prompt_tokens=fields["prompt_tokens"].astype(np.int64),
                 output_tokens=fields["output_tokens"].astype(np.int64))
