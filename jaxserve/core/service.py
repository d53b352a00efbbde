"""The static-batch service-time closed form of `docs/contract_static.md`, and what follows from it.

`service_time` is the one place T(S) is written; it is plain arithmetic, so it runs on numpy
float64 arrays on the host (fits, tuning, capacity estimates) and on jax arrays inside the
engine alike. `batch_service_time` is the engine's float32 form. `full_batch_rate` is the
one notion of a GPU's service capacity used across the package (requests per second when it
serves full batches).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.types import (PROFILE_FLOAT_FIELDS, PROFILE_INT_FIELDS, GPUProfile,
                                 validate_profile)

SERVICE_FIELDS = ("c0", "alpha", "alpha2", "beta", "gamma", "delta")


def service_time(gpu, size, sum_prompt, sum_prompt_sq, max_output):
    """Seconds a static batch occupies a GPU, in the inputs' own array type and dtype.

    T(S) = c0 + alpha*sum p + alpha2*sum p^2 + max o * (beta + gamma*|S| + delta*sum p).
    All arguments broadcast against the profile's leaves (scalars or `(num_gpus,)`).

    Args:
      gpu (GPUProfile): profile(s) of the GPU(s) running the batch (jax or numpy leaves,
        e.g. from `host_profile`).
      size (array-like): |S|, requests in the batch.
      sum_prompt (array-like): sum of prompt tokens in the batch.
      sum_prompt_sq (array-like): sum of squared prompt tokens.
      max_output (array-like): longest output (tokens) in the batch.
    """
    decode_iter = gpu.beta + gpu.gamma * size + gpu.delta * sum_prompt
    return gpu.c0 + gpu.alpha * sum_prompt + gpu.alpha2 * sum_prompt_sq + max_output * decode_iter


def batch_service_time(gpu: GPUProfile, size, sum_prompt, sum_prompt_sq, max_output):
    """`service_time` in float32 jax arrays: the engine's form."""
    size = jnp.asarray(size, jnp.float32)
    return jnp.asarray(service_time(gpu, size, sum_prompt, sum_prompt_sq, max_output),
                       jnp.float32)


def single_request_time(gpu: GPUProfile, prompt, output):
    """Seconds one request runs alone (a batch of one); broadcasts like `batch_service_time`."""
    prompt = jnp.asarray(prompt, jnp.float32)
    return batch_service_time(gpu, 1, prompt, prompt * prompt, jnp.asarray(output, jnp.float32))


def per_request_work(gpu: GPUProfile, prompt, output_estimate):
    """A request's share (s) of a full batch's service time, used for "queued work" features.

    Prefill terms are per request; the per-batch terms (`c0`, and `beta` per decode iteration)
    are shared by the `max_batch` requests of a full batch. Summed over a FIFO queue this is a
    lower bound of the time to serve it in full batches (a batch's decode runs for its longest
    output, not the mean).
    """
    b = jnp.maximum(gpu.max_batch, 1).astype(jnp.float32)
    return (gpu.c0 / b + gpu.alpha * prompt + gpu.alpha2 * prompt * prompt
            + output_estimate * (gpu.beta / b + gpu.gamma + gpu.delta * prompt))


def host_profile(gpus: Any) -> GPUProfile:
    """A cluster's profile with float64 numpy `(num_gpus,)` leaves, for host-side arithmetic.

    Accepts a `GPUProfile` (one GPU's scalars or a stacked cluster) or a sequence of them;
    raises ValueError (naming the field) for an invalid profile or an empty sequence.
    """
    if isinstance(gpus, GPUProfile):
        validate_profile(gpus, where="gpus")
    else:
        gpus = list(gpus)
        if not gpus:
            raise ValueError("gpus must name at least one GPUProfile (got zero GPUs)")
        for i, g in enumerate(gpus):
            if not isinstance(g, GPUProfile):
                raise ValueError(f"gpus[{i}] must be a GPUProfile, got {type(g).__name__}")
            validate_profile(g, where=f"gpus[{i}]")
        # Stacked here in float64 (stack_profiles would round the coefficients to float32).
        return GPUProfile(name="cluster", **{
            f: np.concatenate([np.atleast_1d(np.asarray(getattr(g, f), np.float64)) for g in gpus])
            for f in PROFILE_FLOAT_FIELDS + PROFILE_INT_FIELDS})
    return jax.tree.map(lambda x: np.atleast_1d(np.asarray(x, np.float64)), gpus)


def full_batch_rate(gpus: Any, prompt, output) -> np.ndarray:
    """Service capacity of each GPU (req/s): `max_batch / E[T(full batch)]`, float64 `(G,)`.

    `prompt`, `output`: token counts, either scalars (every request of that size: the
    nominal capacity at mean sizes) or `(S, >= max(max_batch))` samples, row `s` the requests
    of the `s`-th sampled batch (each GPU takes the first `max_batch` of a row). A lower
    bound of what the GPU can sustain only in so far as full batches form; the same notion
    everywhere (offered load, capacity search bounds, SITA's speeds).
    """
    g = host_profile(gpus)
    b = np.maximum(g.max_batch, 1).astype(int)
    p = np.asarray(prompt, np.float64)
    o = np.asarray(output, np.float64)
    if p.ndim == 0 and o.ndim == 0:
        t = service_time(g, b, b * p, b * p * p, o)
        return b / np.maximum(t, 1e-30)
    p, o = np.atleast_2d(p), np.atleast_2d(o)
    if p.shape != o.shape or p.shape[1] < b.max():
        raise ValueError(f"prompt/output samples must share a shape (S, >= {b.max()}), got "
                         f"{p.shape} and {o.shape}")
    rate = np.empty(b.shape[0])
    for i, bi in enumerate(b):
        gi = jax.tree.map(lambda x: x[i], g)
        pi, oi = p[:, :bi], o[:, :bi]
        t = service_time(gi, bi, pi.sum(1), (pi * pi).sum(1), oi.max(1))
        rate[i] = bi / max(float(t.mean()), 1e-30)
    return rate
