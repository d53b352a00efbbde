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

# Bounds that follow from the engines' arithmetic, checked on the host (ValueError naming the
# field) so that nothing accepted can overflow inside jit.
INT32_MAX = 2 ** 31 - 1
# Token counts: a request carries its prompt and output as float32 (`queues.Request`), exact
# for integers up to 2^24, and the continuous engine computes `ceil((p + o) / b)` and prefix
# sums over a replica's slots in int32 (`replica_state.never_fits`, `scheduler.schedule`). A
# prompt, an output, and their sum are each at most `MAX_TOKENS`; the per-slot headroom is
# checked where the slot count is known (`envs.common.check_token_headroom`).
MAX_TOKENS = 2 ** 24
# Queue and batch slots become static array sizes (one slot per request, per GPU, per env).
MAX_SLOTS = 2 ** 16
# Time-valued parameters (s): float32 keeps 7 digits, and `count * seconds` sums (the reward's
# time-in-system) stay far below float32's 3.4e38.
MAX_SECONDS = 1e9


def numeric_array(value, where: str) -> np.ndarray:
    """`value` as a numpy array of numbers (bool, int or float dtype), else ValueError.

    Strings, None and objects are refused by name instead of failing inside numpy (e.g.
    `max_batch="8"`).
    """
    try:
        a = np.asarray(value)
    except Exception:  # noqa: BLE001 - anything numpy cannot read is refused the same way
        raise ValueError(f"{where} must be a number, got {value!r}") from None
    if a.dtype.kind not in "biuf":
        raise ValueError(f"{where} must be a number, got {value!r}")
    return a


def check_int_array(value, where: str, low: int = 1, high: int = INT32_MAX) -> np.ndarray:
    """`value` as int64 integers in `[low, high]` (integral floats accepted), else ValueError.

    Booleans and strings are refused: a flag where a count is expected is a mistake.
    """
    a = numeric_array(value, where)
    if a.dtype.kind == "b":
        raise ValueError(f"{where} must be an integer, got {value!r}")
    f = a.astype(np.float64)
    if not np.all(np.isfinite(f)) or np.any(f != np.round(f)):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    if np.any(f < low) or np.any(f > high):
        raise ValueError(f"{where} must be in [{low}, {high}], got {value!r}")
    return f.astype(np.int64)


@struct.dataclass
class GPUProfile:
    """Service model and batcher settings of one GPU (scalars) or a cluster (`(N,)` arrays).

    Service time of a static batch `S` (seconds), per `docs/contract_static.md`:

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
    """Raises ValueError naming the field if a profile (scalar or stacked) is invalid.

    Coefficients are finite numbers in `[0, MAX_SECONDS]`; `max_batch` and `queue_cap`
    integers in `[1, MAX_SLOTS]`.
    """
    for f in PROFILE_FLOAT_FIELDS:
        v = numeric_array(getattr(profile, f), f"{where}.{f}").astype(np.float64)
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{where}.{f} must be finite, got {v}")
        if np.any(v < 0):
            raise ValueError(f"{where}.{f} must be >= 0, got {v}")
        if np.any(v > MAX_SECONDS):
            raise ValueError(f"{where}.{f} must be <= {MAX_SECONDS:g}, got {v}")
    for f in PROFILE_INT_FIELDS:
        check_int_array(getattr(profile, f), f"{where}.{f}", 1, MAX_SLOTS)


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
      prompt_tokens: prompt lengths, integers in `[1, MAX_TOKENS]`. `(n,)`.
      output_tokens: output lengths, integers in `[1, MAX_TOKENS]`, with prompt + output
        <= `MAX_TOKENS` (2^24). `(n,)`.
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

    Raises ValueError naming the field for: non-numeric, non-1-D or mismatched lengths, fewer
    than `min_len` rows, NaN/inf or decreasing arrivals, a gap between arrivals over
    `MAX_SECONDS`, token counts < 1, non-integer or over `MAX_TOKENS`, or a request whose
    prompt + output exceeds `MAX_TOKENS`.
    """
    if not isinstance(trace, Trace):
        raise ValueError(f"trace must be a jaxserve.Trace, got {type(trace).__name__}")
    fields = {}
    for f in ("arrival_s", "prompt_tokens", "output_tokens"):
        v = numeric_array(getattr(trace, f), f"Trace.{f}")
        if v.dtype.kind == "b":
            raise ValueError(f"Trace.{f} must hold numbers, not booleans")
        fields[f] = v.astype(np.float64)
    arr = fields["arrival_s"]
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
        if np.any(v > MAX_TOKENS):
            bad = int(np.flatnonzero(v > MAX_TOKENS)[0])
            raise ValueError(f"Trace.{f}[{bad}] must be <= {MAX_TOKENS} tokens, got {v[bad]:.0f}")
    total = fields["prompt_tokens"] + fields["output_tokens"]
    if np.any(total > MAX_TOKENS):
        bad = int(np.flatnonzero(total > MAX_TOKENS)[0])
        raise ValueError(f"Trace.prompt_tokens[{bad}] + Trace.output_tokens[{bad}] must be <= "
                         f"{MAX_TOKENS} tokens, got {total[bad]:.0f}")
    if n > 1 and np.any(np.diff(arr) > MAX_SECONDS):
        bad = int(np.flatnonzero(np.diff(arr) > MAX_SECONDS)[0]) + 1
        raise ValueError(f"Trace.arrival_s[{bad}] comes {arr[bad] - arr[bad - 1]:g} s after "
                         f"entry {bad - 1}; gaps must be <= {MAX_SECONDS:g} s")
    return Trace(arrival_s=arr, prompt_tokens=fields["prompt_tokens"].astype(np.int64),
                 output_tokens=fields["output_tokens"].astype(np.int64))
