"""Continuous-batching replica profiles (`docs/contract_continuous.md`).

A `ReplicaProfile` holds one replica's iteration-time coefficients, KV-cache size and vLLM
scheduler limits as scalars, or a whole cluster's as `(num_replicas,)` arrays
(`stack_replicas`); both are valid leaf sets for `jax.vmap` over parameters. `name` is the only
static field. Validation runs on the host and raises `ValueError` naming the field.

Iteration time of a batch that computes `n_r` tokens of each scheduled request `r`:

    T = c0 + alpha * sum n + alpha2 * sum_{prefilling} n (C + n)
           + beta * [any decoding] + gamma * #decoding + delta * sum_{decoding} L
           + moe * min(sum n, moe_tokens)

The last term is a mixture-of-experts model's expert-weight cost: each step reads the weights
of the experts its tokens activate, and under a balanced gate `n` tokens with `k` experts each
activate `min(n k, E)` of `E`, so the cost grows with the step's tokens until
`moe_tokens = E / k` and is flat beyond (dense models: `moe = 0`).

`gamma` may be negative down to `-alpha`: a decoding sequence then costs `alpha + gamma >= 0`
per iteration, which is what fits with a cheaper decode token than prefill token need
(DistServe's OPT-13B fits below).

Named profiles (`replica_profile(name)`), sources:

* `opt13b-a100-80g`: OPT-13B on one A100-80GB, DistServe's fits (Zhong et al., OSDI 2024,
  as quoted in MODEL_CONTINUOUS.md), in ms: prefill `18.10 + 0.1019 * sum l + 7.12e-6 * sum l^2`,
  decode `19.93 + 6.27e-4 * sum context + 0.0385 * batch`. Mapped to the iteration form:
  a prefill-only iteration gives `c0 = 18.10 ms`, `alpha = 0.1019 ms`, `alpha2 = 7.12e-6 ms`;
  a decode-only iteration of `B` sequences gives `c0 + beta = 19.93 ms` (`beta = 1.83 ms`),
  `alpha + gamma = 0.0385 ms` (`gamma = -0.0634 ms`), `delta = 6.27e-4 ms`.
  KV blocks from `kv_blocks_for`: 40 layers, hidden 5120, fp16 (800 KiB per token), 80 GB at
  vLLM's `gpu_memory_utilization = 0.9`, 25.7 GB of weights (12.85e9 params, fp16), 2 GB kept
  for activations -> 3379 blocks of 16 tokens (54,064 tokens).
* `opt13b-a100-40g`: the same coefficients with a 40 GB card's KV cache (633 blocks: 8.3 GB
  left after weights and activations at 0.9 utilisation).
  DERIVED, not measured: A100-40GB has less memory bandwidth (1.56 vs 2.04 TB/s), so its
  decode is slower than this profile says.

Scheduler settings (not measurements), `ReplicaProfile`'s field defaults, which the named
profiles keep: vLLM's `block_size = 16`, `watermark = 0.01`; `max_seqs = 64`,
`max_tokens = 2048`, chunked prefill on, `queue_cap = 64`.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.core.types import INT32_MAX, MAX_SECONDS, MAX_SLOTS, check_int_array, numeric_array

REPLICA_FLOAT_FIELDS = ("c0", "alpha", "alpha2", "beta", "gamma", "delta", "moe", "watermark")
REPLICA_INT_FIELDS = ("kv_blocks", "block_size", "max_seqs", "max_tokens", "queue_cap")
REPLICA_BOOL_FIELDS = ("chunked_prefill",)


@struct.dataclass
class ReplicaProfile:
    """One continuous-batching replica (scalars) or a cluster of them (`(N,)` arrays).

    Attributes:
      c0: fixed cost of one iteration (s).
      alpha: cost per token computed in the iteration, prefill or decode (s/token).
      alpha2: prefill attention: a chunk of `n` tokens after `C` computed ones costs
        `alpha2 * n * (C + n)` (s/token^2).
      beta: extra cost of an iteration that holds any decode (s).
      gamma: cost per decoding sequence (s); `>= -alpha`.
      delta: decode attention, per token of context read (s/token).
      moe: expert-weight cost per token of the step, up to `moe_tokens` tokens (s/token); 0
        for a dense model.
      moe_tokens: tokens at which every expert is active (`ceil(E / k)`: experts over experts
        per token), beyond which `moe`'s term is flat. Static (not a pytree leaf), shared by a
        stacked cluster: 1, the default, means a dense model and leaves the term out of the
        traced program altogether, so dense profiles compute exactly what they did before
        the term existed (a `moe * min(tokens, 1)` would only be a second `c0`).
      kv_blocks: KV-cache blocks of the replica (M).
      block_size: tokens per block (b).
      max_seqs: most sequences running at once (S, vLLM `max_num_seqs`).
      max_tokens: token budget of one iteration (K, vLLM `max_num_batched_tokens`).
      chunked_prefill: whether a prompt may be split across iterations. bool.
      watermark: fraction of M kept free when admitting (w).
      queue_cap: most requests waiting to be admitted, preempted ones not counted (Q).
      name: label, not a pytree leaf.
    """

    c0: float = 0.02
    alpha: float = 1e-4
    alpha2: float = 0.0
    beta: float = 0.0
    gamma: float = 0.0
    delta: float = 0.0
    moe: float = 0.0
    kv_blocks: int = 2048
    block_size: int = 16
    max_seqs: int = 64
    max_tokens: int = 2048
    chunked_prefill: bool = True
    watermark: float = 0.01
    queue_cap: int = 64
    name: str = struct.field(pytree_node=False, default="custom")
    moe_tokens: int = struct.field(pytree_node=False, default=1)



def iteration_time(prof: ReplicaProfile, tokens, prefill_attention, decodes, decode_context):
    """Seconds one continuous-batching iteration lasts (the formula in this module's docstring,
    `docs/contract_continuous.md`):

        T = c0 + alpha * tokens + alpha2 * prefill_attention
              + beta * [decodes > 0] + gamma * decodes + delta * decode_context
              + moe * min(tokens, moe_tokens)

    Args (per replica, broadcasting against `prof`'s leaves):
      tokens: tokens computed in the iteration, prefill and decode (`sum n`).
      prefill_attention: `sum_{prefilling} n (C + n)` over the prefilling requests, each
        computing `n` tokens after `C` computed ones (tokens^2).
      decodes: decoding sequences in the iteration (a count, as a float).
      decode_context: tokens of context the decodes read, `sum_{decoding} L`.

    The engine's step (`core.continuous`) computes every iteration with it. Closed forms over
    runs of iterations (`core.continuous`'s decode-run skip, `core.continuous_load`'s
    estimates) expand it algebraically, in another float order, and say so where they do.
    """
    t = (prof.c0 + prof.alpha * tokens + prof.alpha2 * prefill_attention
         + prof.beta * (decodes > 0) + prof.gamma * decodes + prof.delta * decode_context)
    if prof.moe_tokens > 1:  # static: a dense profile's program is unchanged by the term
        t = t + prof.moe * jnp.minimum(tokens, prof.moe_tokens)
    return t

def validate_replica(profile: ReplicaProfile, where: str = "ReplicaProfile") -> None:
    """Raises ValueError naming the field if a profile (scalar or stacked) is invalid.

    Coefficients are finite numbers with magnitude <= `MAX_SECONDS`; `chunked_prefill` a
    boolean (Python or numpy bool: a string such as "no" is refused, not read as True);
    `max_seqs` and `queue_cap` integers in `[1, MAX_SLOTS]`, the other integer fields in
    `[1, 2^31 - 1]` with `kv_blocks * block_size` (the cache's tokens) <= 2^31 - 1 too.
    """
    if not isinstance(profile, ReplicaProfile):
        raise ValueError(f"{where} must be a ReplicaProfile, got {type(profile).__name__}")
    vals = {}
    for f in REPLICA_FLOAT_FIELDS:
        v = numeric_array(getattr(profile, f), f"{where}.{f}").astype(np.float64)
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{where}.{f} must be finite, got {v}")
        if np.any(np.abs(v) > MAX_SECONDS):
            raise ValueError(f"{where}.{f} must be <= {MAX_SECONDS:g} in magnitude, got {v}")
        if f != "gamma" and np.any(v < 0):
            raise ValueError(f"{where}.{f} must be >= 0, got {v}")
        vals[f] = v
    if np.any(vals["alpha"] + vals["gamma"] < 0):
        raise ValueError(f"{where}.gamma must be >= -alpha (a decoding sequence cannot cost "
                         f"less than nothing), got gamma={vals['gamma']}, alpha={vals['alpha']}")
    if np.any(vals["c0"] + vals["alpha"] <= 0):
        raise ValueError(f"{where}: c0 + alpha must be > 0 (every iteration takes time)")
    if np.any(vals["watermark"] >= 1):
        raise ValueError(f"{where}.watermark must be in [0, 1), got {vals['watermark']}")
    for f in REPLICA_INT_FIELDS:
        high = MAX_SLOTS if f in ("max_seqs", "queue_cap") else INT32_MAX
        vals[f] = check_int_array(getattr(profile, f), f"{where}.{f}", 1, high)
    if np.any(vals["kv_blocks"] * vals["block_size"] > INT32_MAX):
        raise ValueError(f"{where}.kv_blocks * block_size (tokens of KV cache) must be <= "
                         f"{INT32_MAX}, got {vals['kv_blocks'] * vals['block_size']}")
    for f in REPLICA_BOOL_FIELDS:
        v = getattr(profile, f)
        if not (isinstance(v, (bool, np.bool_)) or np.asarray(v).dtype == np.bool_):
            raise ValueError(f"{where}.{f} must be a boolean (True/False), got {v!r}")
    kv = np.asarray(profile.kv_blocks)
    if np.any(kv - np.floor(vals["watermark"] * kv) < 1):
        raise ValueError(f"{where}.kv_blocks leaves no block above the watermark")
    mt = profile.moe_tokens
    if isinstance(mt, (bool, np.bool_)) or not isinstance(mt, (int, np.integer)) or not (
            1 <= mt <= INT32_MAX):
        raise ValueError(f"{where}.moe_tokens must be an integer in [1, {INT32_MAX}], got {mt!r}")
    if mt == 1 and np.any(vals["moe"] != 0):
        raise ValueError(f"{where}.moe needs moe_tokens >= 2 (the tokens at which every expert "
                         f"is active); with moe_tokens = 1 the term would be a constant: add it "
                         f"to c0")


def stack_replicas(profiles: Sequence[ReplicaProfile]) -> ReplicaProfile:
    """Stacks per-replica profiles into one with `(num_replicas,)` leaves (float32/int32/bool).

    Raises ValueError for an empty sequence or an invalid profile.
    """
    profiles = list(profiles)
    if not profiles:
        raise ValueError("replicas must name at least one ReplicaProfile (got zero)")
    for i, p in enumerate(profiles):
        validate_replica(p, where=f"replicas[{i}]")
    kw = {f: jnp.asarray([float(getattr(p, f)) for p in profiles], jnp.float32)
          for f in REPLICA_FLOAT_FIELDS}
    kw.update({f: jnp.asarray([int(getattr(p, f)) for p in profiles], jnp.int32)
               for f in REPLICA_INT_FIELDS})
    kw.update({f: jnp.asarray([bool(getattr(p, f)) for p in profiles], jnp.bool_)
               for f in REPLICA_BOOL_FIELDS})
    moe_tokens = {int(p.moe_tokens) for p in profiles}
    if len(moe_tokens) > 1:
        raise ValueError(f"replicas must share moe_tokens (a static field of the cluster's "
                         f"program), got {sorted(moe_tokens)}")
    return ReplicaProfile(name="+".join(p.name for p in profiles), moe_tokens=moe_tokens.pop(),
                          **kw)


def kv_blocks_for(num_layers: int, kv_hidden: int, gpu_mem_gb: float, weight_gb: float, *,
                  dtype_bytes: int = 2, mem_util: float = 0.9, activation_gb: float = 2.0,
                  block_size: int = 16) -> int:
    """KV-cache blocks a replica holds, the way vLLM sizes its cache.

    `(gpu_mem_gb * mem_util - weight_gb - activation_gb) * 1e9` bytes are divided by the bytes
    of one block: `2 (K and V) * num_layers * kv_hidden * dtype_bytes * block_size`.
    `kv_hidden` is `num_kv_heads * head_dim` (the hidden size without grouped-query attention).
    """
    free = (gpu_mem_gb * mem_util - weight_gb - activation_gb) * 1e9
    per_block = 2 * num_layers * kv_hidden * dtype_bytes * block_size
    blocks = int(math.floor(free / per_block))
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({free / 1e9:.1f} GB)")
    return blocks


_MS = 1e-3
_OPT13B = dict(c0=18.10 * _MS, alpha=0.1019 * _MS, alpha2=7.12e-6 * _MS,
               beta=(19.93 - 18.10) * _MS, gamma=(0.0385 - 0.1019) * _MS, delta=6.27e-4 * _MS)
_OPT13B_WEIGHTS_GB = 12.85e9 * 2 / 1e9

# The named profiles' own fields; their scheduler settings (block_size, max_seqs,
# max_tokens, chunked_prefill, watermark, queue_cap) are `ReplicaProfile`'s field defaults.
NAMED_REPLICAS = {
    "opt13b-a100-80g": dict(**_OPT13B,
                            kv_blocks=kv_blocks_for(40, 5120, 80.0, _OPT13B_WEIGHTS_GB)),
    "opt13b-a100-40g": dict(**_OPT13B,
                            kv_blocks=kv_blocks_for(40, 5120, 40.0, _OPT13B_WEIGHTS_GB)),
}


def replica_profile(name: str, **overrides) -> ReplicaProfile:
    """The named profile (see the module docstring), with fields replaced by `overrides`."""
    if name not in NAMED_REPLICAS:
        raise ValueError(f"unknown replica profile {name!r}; known: {sorted(NAMED_REPLICAS)}")
    fields = {**NAMED_REPLICAS[name], **overrides}
    prof = ReplicaProfile(name=name, **fields)
    validate_replica(prof, where=f"replica_profile({name!r})")
    return prof
