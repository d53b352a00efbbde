"""The static-batch service-time closed form of `shared/MODEL.md`."""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.core.types import GPUProfile


def batch_service_time(gpu: GPUProfile, size, sum_prompt, sum_prompt_sq, max_output):
    """Seconds a static batch occupies a GPU.

    T(S) = c0 + alpha*sum p + alpha2*sum p^2 + max o * (beta + gamma*|S| + delta*sum p).
    All arguments broadcast against the profile's leaves (scalars or `(num_gpus,)`).

    Args:
      gpu: profile(s) of the GPU(s) running the batch.
      size: |S|, requests in the batch.
      sum_prompt: sum of prompt tokens in the batch.
      sum_prompt_sq: sum of squared prompt tokens.
      max_output: longest output (tokens) in the batch.

    Returns:
      float32 seconds, same broadcast shape.
    """
    size = jnp.asarray(size, jnp.float32)
    decode_iter = gpu.beta + gpu.gamma * size + gpu.delta * sum_prompt
    return (gpu.c0 + gpu.alpha * sum_prompt + gpu.alpha2 * sum_prompt_sq
            + max_output * decode_iter).astype(jnp.float32)


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
