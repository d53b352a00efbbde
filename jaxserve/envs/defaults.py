"""Defaults and parameter assembly shared by every environment builder.

`build_params` assembles `ServingParams` from user-level pieces; every builder
(`make_routing`, `make_batching`, ... beside their environments) takes them as keywords:
  gpus: list of `GPUProfile` (Routing-v0: the cluster; Batching-v0: exactly one).
  queue_buffer: static queue slots per GPU (default: the largest `queue_cap`).
  arrivals: an `ArrivalProcess` (`core.arrivals.poisson`, `mmpp`), or
  arrival_rate: a Poisson rate (req/s).
  tokens: a `TokenDist` (`fixed_tokens`, `lognormal_tokens`, `bimodal_tokens`, `empirical_tokens`).
  trace: a `Trace` to replay instead of synthetic arrivals (episode = the trace).
  Any scalar field of `ServingParams` (slo_s, max_steps_in_episode, estimate_mode, ...).
Autoscaling-v0 also takes `max_replicas`, `gpu` (one profile for every replica slot),
`history_len` and the scalar fields of `AutoscalingParams` (control_interval_s, warmup_s,
gpu_price, latency_weight, slo_penalty_s, diurnal_amplitude, diurnal_period_s,
diurnal_phase_s, initial_replicas, action_mode, random_phase, random_initial,
invalid_penalty_s).

Where defaults live (docs/index.md): the defaults every environment shares are
`ServingParams`' field defaults (`envs.common`); each environment's own (cluster, workload,
SLO, what routers see) are its `*_DEFAULTS` dict beside its builder (`envs.routing.
ROUTING_DEFAULTS`, ...), applied with `fill_defaults` under the caller's keywords; named
scenarios are overrides between the two (`ROUTING_SCENARIOS`, `PREFIX_SCENARIOS`,
`envs.autoscaling_workloads`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxserve.core import arrivals as A
from jaxserve.core.sources import no_trace, trace_arrays
from jaxserve.core.types import MAX_SLOTS, stack_profiles
from jaxserve.envs import common
from jaxserve.envs.base import as_size
# The shared defaults are `ServingParams`' field defaults (`envs.common`); re-exported here,
# where builders and readers have looked for them.
from jaxserve.envs.common import (DEFAULT_DROP_PENALTY_S, DEFAULT_LATENCY_SCALE,  # noqa: F401
                                  DEFAULT_SIZE_EDGES, DEFAULT_SIZE_VALUES, DEFAULT_SLO_MISS_S,
                                  DEFAULT_SLO_TPOT_S, DEFAULT_SLO_TTFT_S)

# `max_steps_in_episode` of an episode that replays a trace: larger than any trace, so the
# episode ends when the trace has drained (termination), not at a synthetic episode length.
TRACE_EPISODE_STEPS = 1_000_000


# What Routing-v0's routers see of a request's output length by default: a noisy prediction,
# what a deployed router could have, never the true length or its true size class (the
# default until commit f3d97b3, an oracle no real router has). `estimate = round(output *
# exp(sigma * z))`, z ~ N(0, 1): the median prediction is the truth and 68% of predictions
# lie within a factor e^sigma of it. sigma = 1.0 (a factor 2.7) stands for a prompt-based
# length predictor: output length given the prompt is itself heavy-tailed (the same prompt
# sampled again gives very different lengths; Zheng et al. 2026, arXiv:2604.00499), so no
# predictor is close to exact. On the default short/long mix it puts 9% of long requests
# below the class edge (128 tokens) and 9% of short ones above it (1e6 draws).
# `estimate_mode=2` (the true size class, an oracle bit) and `estimate_mode=0` (the true
# length) stay available as named options for clairvoyant references.
ROUTING_ESTIMATE_MODE = A.ESTIMATE_NOISY
ROUTING_ESTIMATE_NOISE = 1.0


def build_params(gpus, *, arrivals=None, arrival_rate=None, tokens=None, trace=None,
                 trace_pad=None, **scalars) -> common.ServingParams:
    """Assembles `ServingParams` from user-level pieces (see the module docstring).

    `gpus` is a list of `GPUProfile` (stacked here) or an already stacked profile pytree
    (e.g. `replica.stack_replicas(...)` for LLMRouting-v0).
    """
    if arrivals is not None and arrival_rate is not None:
        raise ValueError("give either arrivals= or arrival_rate=, not both")
    if arrival_rate is not None:
        rate = common.scalar_leaf("arrival_rate", arrival_rate, jnp.float32, where="")
        if rate.ndim != 0:
            raise ValueError(f"arrival_rate must be one number (req/s), got {arrival_rate!r}")
        arrivals = A.poisson(float(arrival_rate))
        try:
            A.validate_arrivals(arrivals)
        except ValueError as e:
            raise ValueError(f"arrival_rate={arrival_rate!r} is invalid: {e}") from None
    if arrivals is None:
        raise ValueError("an arrival process is required (arrivals= or arrival_rate=)")
    if not isinstance(arrivals, A.ArrivalProcess):
        raise ValueError(f"arrivals must be an ArrivalProcess, got {type(arrivals).__name__}")
    if tokens is None:
        tokens = A.bimodal_tokens()
    if not isinstance(tokens, A.TokenDist):
        raise ValueError(f"tokens must be a TokenDist, got {type(tokens).__name__}")
    names = {f.name for f in dataclasses.fields(common.ServingParams)}
    unknown = sorted(set(scalars) - names)
    if unknown:
        raise ValueError(f"unknown environment parameter {unknown[0]!r}; known: "
                         f"{sorted(names)}")
    arrays = {k: jnp.asarray(scalars.pop(k), jnp.float32)
              for k in ("size_edges", "size_values") if k in scalars}
    params = common.ServingParams(
        gpus=stack_profiles(gpus) if isinstance(gpus, (list, tuple)) else gpus,
        arrivals=arrivals, tokens=tokens,
        trace=no_trace() if trace is None else trace_arrays(trace, trace_pad),
        **arrays, **scalars)
    # Every scalar field, given or defaulted, cast to its dtype (`common.scalar_leaf`).
    return common.override(params, **{k: getattr(params, k) for k in common.SCALAR_FIELDS})


def static_sizes(queue_buffer, params):
    """(queue buffer, max batch) shapes for `params`, validated."""
    caps = int(np.max(np.asarray(params.gpus.queue_cap)))
    qb = caps if queue_buffer is None else as_size("queue_buffer", queue_buffer, high=MAX_SLOTS)
    mb = int(np.max(np.asarray(params.gpus.max_batch)))
    common.validate_params(params, qb, mb)
    return qb, mb



def refuse_gpus(name: str, kw: dict) -> None:
    """Raises ValueError if the keywords `kw` of a continuous-batching env's builder hold
    `gpus=`: those envs take `replicas=` (and pass their stacked replicas to `build_params`
    as its `gpus` themselves)."""
    if "gpus" in kw:
        raise ValueError(f"{name} takes replicas= (a list of ReplicaProfile, e.g. "
                         f"jaxserve.replica_profile(...)), not gpus=")


def replica_sizes(prof, queue_buffer, max_seqs) -> tuple[int, int]:
    """(queue buffer, running slots) of a continuous-batching env over the stacked replica
    profile `prof`: the largest `queue_cap` and `max_seqs` unless given, validated."""
    qb = (int(np.max(np.asarray(prof.queue_cap))) if queue_buffer is None
          else as_size("queue_buffer", queue_buffer, high=MAX_SLOTS))
    ms = (int(np.max(np.asarray(prof.max_seqs))) if max_seqs is None
          else as_size("max_seqs", max_seqs, high=MAX_SLOTS))
    return qb, ms


def fill_defaults(kw: dict, defaults: dict, exclude: tuple[str, ...] = ()) -> dict:
    """`kw` (a builder's keywords) with each entry of an environment's `defaults` dict that
    `kw` lacks (as `dict.setdefault`: a key given as None stays None), but those named in
    `exclude` (which the builder applies itself); a callable default (a cluster, a token
    law) is called, so every build gets fresh arrays. Returns `kw`, filled in place."""
    for k, v in defaults.items():
        if k not in exclude and k not in kw:
            kw[k] = v() if callable(v) else v
    return kw
