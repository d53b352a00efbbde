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

The constants below are the defaults more than one environment shares; each environment's
own scenario (cluster, workload, scales) lives in its module, beside the builder.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.core import arrivals as A
from jaxserve.core.sources import no_trace, trace_arrays
from jaxserve.core.types import MAX_SLOTS, stack_profiles
from jaxserve.envs import common
from jaxserve.envs.base import as_size

# A dropped request costs as much as this many seconds in the system: far above any latency
# the default scenarios produce, so dropping is never cheaper than serving (every registered
# environment's default).
DEFAULT_DROP_PENALTY_S = 600.0
# Seconds of time-in-system per unit of (negative) reward in Routing-v0 and Batching-v0, chosen
# so that discounted returns (gamma 0.99) are O(1) for an unnormalised PPO (docs/training.md).
DEFAULT_LATENCY_SCALE = 1000.0
# `max_steps_in_episode` of an episode that replays a trace: larger than any trace, so the
# episode ends when the trace has drained (termination), not at a synthetic episode length.
TRACE_EPISODE_STEPS = 1_000_000

# LLM SLO targets (a choice, as in docs/continuous.md's study): time to first token <= 2 s and
# time per output token <= 0.1 s; an SLO miss costs 60 s of time-in-system in the SLO reward
# (a tenth of a drop, so shedding a request is never cheaper than serving it late).
DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.1
DEFAULT_SLO_MISS_S = 60.0

# Default profiles (see docs/profiles.md for the named, sourced ones).
DEFAULT_SIZE_EDGES = (128.0,)
DEFAULT_SIZE_VALUES = (48.0, 512.0)


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
    defaults = dict(estimate_mode=A.ESTIMATE_CLASS, estimate_noise=0.5, slo_s=10.0,
                    latency_scale=10.0, drop_penalty_s=60.0, time_scale=10.0,
                    max_steps_in_episode=512, slo_ttft_s=DEFAULT_SLO_TTFT_S,
                    slo_tpot_s=DEFAULT_SLO_TPOT_S, slo_miss_s=DEFAULT_SLO_MISS_S)
    size_edges = scalars.pop("size_edges", DEFAULT_SIZE_EDGES)
    size_values = scalars.pop("size_values", DEFAULT_SIZE_VALUES)
    defaults.update(scalars)
    params = common.ServingParams(
        gpus=stack_profiles(gpus) if isinstance(gpus, (list, tuple)) else gpus,
        arrivals=arrivals, tokens=tokens,
        size_edges=jnp.asarray(size_edges, jnp.float32),
        size_values=jnp.asarray(size_values, jnp.float32),
        trace=no_trace() if trace is None else trace_arrays(trace, trace_pad),
        **{k: jnp.asarray(0, common.SCALAR_FIELDS[k]) for k in common.SCALAR_FIELDS})
    return common.override(params, **defaults)


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


def set_reward_scales(kw: dict) -> None:
    """Sets the reward scales every environment shares in the builder keywords `kw` where the
    caller gave none: `drop_penalty_s = DEFAULT_DROP_PENALTY_S`, `latency_scale =
    DEFAULT_LATENCY_SCALE`."""
    kw.setdefault("drop_penalty_s", DEFAULT_DROP_PENALTY_S)
    kw.setdefault("latency_scale", DEFAULT_LATENCY_SCALE)
