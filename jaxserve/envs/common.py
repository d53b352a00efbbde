"""What the serving environments share: parameters, request sources, validation, features.

Static configuration (shapes: number of GPUs, queue buffer, trace window length) is a frozen
dataclass on the environment instance (`envs.base.StaticConfig`); everything a user may sweep
(GPU coefficients, batch limits, arrival rates, token distributions, SLO, reward weights,
episode length) is an array leaf of `ServingParams`, so `vmap` over params needs no recompile.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.core import arrivals as A
from jaxserve.core.queues import Request
from jaxserve.core.sources import TraceArrays
from jaxserve.core.types import GPUProfile, validate_profile


@struct.dataclass
class ServingParams:
    """Vmappable parameters of a serving environment.

    Attributes:
      gpus: the cluster's GPU profiles, `(num_gpus,)` leaves.
      arrivals: arrival process (MMPP; Poisson is one phase). Unused when `trace` has rows.
      tokens: token-length distribution. Unused when `trace` has rows.
      estimate_mode: what schedulers see of output lengths: 0 exact, 1 noisy, 2 size class
        (the default; a real scheduler rarely knows the true length). int32.
      estimate_noise: lognormal sigma of the noisy estimate. float32.
      size_edges: `(E,)` output-length class boundaries (tokens).
      size_values: `(E + 1,)` representative output length of each class (tokens).
      slo_s: latency SLO (s) for the SLO-met / goodput counters.
      latency_scale: seconds of time-in-system per unit of (negative) reward.
      drop_penalty_s: a dropped request costs as much reward as this many seconds in system.
      time_scale: seconds per unit of time-valued observation features.
      max_steps_in_episode: decisions per episode (gymnax truncation). int32.
      slo_ttft_s, slo_tpot_s: per-request LLM SLO targets (DistServe's goodput): a request
        attains its SLO when its time to first token is <= `slo_ttft_s` (s) and its time per
        output token after the first is <= `slo_tpot_s` (s/token). Read by LLMRouting-v0's
        SLO reward (`reward="slo"`).
      slo_miss_s: cost of one SLO miss in that reward, in seconds of time-in-system (so
        it shares `latency_scale` and `drop_penalty_s` with the time-in-system reward).
      trace: replayed requests; when it has rows they replace `arrivals` and `tokens`, and the
        episode terminates at the trace's end.
    """

    gpus: GPUProfile
    arrivals: A.ArrivalProcess
    tokens: A.TokenDist
    estimate_mode: jax.Array
    estimate_noise: jax.Array
    size_edges: jax.Array
    size_values: jax.Array
    slo_s: jax.Array
    latency_scale: jax.Array
    drop_penalty_s: jax.Array
    time_scale: jax.Array
    max_steps_in_episode: jax.Array
    slo_ttft_s: jax.Array
    slo_tpot_s: jax.Array
    slo_miss_s: jax.Array
    trace: TraceArrays


SCALAR_FIELDS = {
    "estimate_mode": jnp.int32, "estimate_noise": jnp.float32, "slo_s": jnp.float32,
    "latency_scale": jnp.float32, "drop_penalty_s": jnp.float32, "time_scale": jnp.float32,
    "max_steps_in_episode": jnp.int32, "slo_ttft_s": jnp.float32, "slo_tpot_s": jnp.float32,
    "slo_miss_s": jnp.float32,
}


def validate_params(params: ServingParams, queue_buffer: int, max_batch: int | None = None,
                    num_gpus: int | None = None) -> None:
    """Host-side checks of a `ServingParams` against an environment's static sizes.

    Raises ValueError naming the field.
    """
    validate_profile(params.gpus, where="params.gpus")
    shape = np.shape(params.gpus.c0)
    if num_gpus is not None and shape[-1:] != (num_gpus,):
        raise ValueError(f"params.gpus has {shape[-1:] or 'no'} GPUs; the environment has "
                         f"{num_gpus}")
    mb = np.asarray(params.gpus.max_batch)
    if max_batch is not None and max_batch < queue_buffer and np.any(mb > max_batch):
        raise ValueError(f"params.gpus.max_batch {mb} exceeds the environment's static "
                         f"max_batch ({max_batch}); rebuild it with a larger max_batch")
    if np.any(np.asarray(params.gpus.queue_cap) > queue_buffer):
        raise ValueError(f"params.gpus.queue_cap {np.asarray(params.gpus.queue_cap)} exceeds the "
                         f"static queue buffer ({queue_buffer}); pass a larger queue_buffer")
    if np.asarray(params.trace.length) == 0:
        A.validate_arrivals(params.arrivals, where="params.arrivals")
        A.validate_tokens(params.tokens, where="params.tokens")
    for f in SCALAR_FIELDS:
        v = np.asarray(getattr(params, f), np.float64)
        if not np.all(np.isfinite(v)) or np.any(v < 0):
            raise ValueError(f"params.{f} must be finite and >= 0, got {v}")
    for f in ("latency_scale", "time_scale", "max_steps_in_episode"):
        if np.any(np.asarray(getattr(params, f)) <= 0):
            raise ValueError(f"params.{f} must be > 0, got {np.asarray(getattr(params, f))}")
    if int(np.asarray(params.estimate_mode)) not in (0, 1, 2):
        raise ValueError("params.estimate_mode must be 0 (exact), 1 (noisy) or 2 (class)")
    edges = np.asarray(params.size_edges, np.float64)
    if edges.ndim != 1 or np.any(np.diff(edges) <= 0) or not np.all(np.isfinite(edges)):
        raise ValueError(f"params.size_edges must be a finite increasing 1-D array, got {edges}")
    if np.asarray(params.size_values).shape != (edges.shape[0] + 1,):
        raise ValueError("params.size_values must have one entry more than params.size_edges")


def draw_request(u: jax.Array, params: ServingParams, arrival, req_id, tokens=None) -> Request:
    """A request arriving at `arrival` (s), from four uniforms `u`.

    Tokens come from `params.tokens` (`u[0:3]`) unless given as a `(prompt, output)` pair
    (e.g. from a trace); `u[3]` draws the output estimate.
    """
    p, o = A.tokens_from_uniforms(u[:3], params.tokens) if tokens is None else tokens
    est, cls = A.estimate_from_uniform(u[3], o, params.estimate_mode, params.estimate_noise,
                                       params.size_edges, params.size_values)
    return Request(arrival=jnp.asarray(arrival, jnp.float32), prompt=p, output=o, estimate=est,
                   size_class=cls, req_id=jnp.asarray(req_id, jnp.int32))


REQUEST_UNIFORMS = 5  # what one request costs: class/row, two normals, estimate, gap


def request_uniforms(key: jax.Array) -> jax.Array:
    """The uniforms of one request (`REQUEST_UNIFORMS`), from one PRNG call on `key`."""
    return A.uniforms(key, REQUEST_UNIFORMS)


def next_arrival(key: jax.Array, params: ServingParams, phase, trace_pos, req_id, u=None):
    """The next request and the gap (s) before it, from the trace or the arrival process.

    One PRNG call draws all of it (a second only for a multi-phase MMPP's gap), or none when
    the caller passes that draw as `u` (`request_uniforms(key)`) to share it.

    Args:
      trace_pos: trace row of the request to produce (ignored without a trace).
    Returns:
      (gap, request arriving at time 0 of the new frame, new phase, exhausted). `exhausted` is
      True when a trace has no row `trace_pos` (the gap is then `inf`).
    """
    u = request_uniforms(key) if u is None else u
    tr = params.trace
    if tr.gap.shape[0] > 0:
        exhausted = trace_pos >= tr.length
        i = jnp.minimum(trace_pos, tr.gap.shape[0] - 1)
        gap = jnp.where(exhausted, jnp.inf, tr.gap[i])
        req = draw_request(u, params, 0.0, req_id, (tr.prompt[i], tr.output[i]))
        return gap, req, phase, exhausted
    if params.arrivals.rates.shape[-1] == 1:  # Poisson: an exponential from u[4]
        gap = -jnp.log(u[4]) / params.arrivals.rates[0]
    else:
        gap, phase = A.sample_gap(jax.random.fold_in(key, 1), phase, params.arrivals)
    return gap, draw_request(u, params, 0.0, req_id), phase, jnp.bool_(False)


def first_phase(key: jax.Array, params: ServingParams, salt: int | None = None) -> jax.Array:
    """The arrival process's phase at reset (its stationary law).

    With `salt`, drawn from `fold_in(key, salt)`, a call made only for a multi-phase MMPP
    (Poisson has one phase and draws nothing).
    """
    if salt is not None and params.arrivals.rates.shape[-1] > 1:
        key = jax.random.fold_in(key, salt)
    return A.sample_phase(key, params.arrivals)


def request_features(req: Request, params: ServingParams) -> jax.Array:
    """The arriving request as 3 features in [0, 1]: log prompt, log output estimate, class."""
    num_classes = params.size_values.shape[-1]
    return jnp.stack([
        jnp.log1p(req.prompt) / jnp.log1p(params.tokens.max_prompt),
        jnp.log1p(req.estimate) / jnp.log1p(params.tokens.max_output),
        req.size_class / jnp.maximum(num_classes - 1, 1),
    ]).astype(jnp.float32)


def reward_from(metrics, params: ServingParams) -> jax.Array:
    """Reward of a step: -(time-in-system + drop_penalty_s * drops) / latency_scale.

    Summed over an episode this is an affine function of the episode's total time-in-system
    (its total latency when the episode drains) and its drops.
    """
    cost = metrics.in_system_time + params.drop_penalty_s * metrics.dropped
    return (-cost / params.latency_scale).astype(jnp.float32)


def shaped_reward(reward, backlog0, backlog1, shaping_gamma: float | None,
                  params: ServingParams) -> jax.Array:
    """`reward` plus the potential-based shaping term `gamma * phi(s') - phi(s)` (Ng, Harada
    and Russell, 1999), `phi = -expected backlog (s) / latency_scale`; `reward` unchanged when
    `shaping_gamma` is None. The backlogs are an environment's estimate of the remaining
    time-in-system of the requests present before and after the step (Routing-v0:
    `routing.expected_backlog`; LLMRouting-v0: `continuous_load.expected_backlog`)."""
    if shaping_gamma is None:
        return reward
    phi0, phi1 = -backlog0 / params.latency_scale, -backlog1 / params.latency_scale
    return (reward + shaping_gamma * phi1 - phi0).astype(jnp.float32)


def check_shaping_gamma(g) -> float | None:
    """`g` as a Python float in [0, 1], or None (no shaping); ValueError naming the field."""
    if g is not None and not 0.0 <= float(g) <= 1.0:
        raise ValueError(f"shaping_gamma must be in [0, 1] or None, got {g}")
    return None if g is None else float(g)


def override(params: ServingParams, **kwargs) -> ServingParams:
    """Replaces scalar fields of `params`, casting to their dtypes; ValueError for unknown."""
    names = {f.name for f in dataclasses.fields(params)}
    for k in kwargs:
        if k not in names:
            raise ValueError(f"unknown environment parameter {k!r}; known: {sorted(names)}")
    cast = {k: (jnp.asarray(v, SCALAR_FIELDS[k]) if k in SCALAR_FIELDS else v)
            for k, v in kwargs.items()}
    return params.replace(**cast)
