"""The environment registry: `make(name, **overrides) -> (env, params)`.

Each entry builds a default scenario; keyword overrides replace parts of it:
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
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxserve.core import arrivals as A
from jaxserve.core.profiles import get_profile
from jaxserve.core.sources import no_trace, trace_arrays
from jaxserve.core.types import GPUProfile, stack_profiles
from jaxserve.envs import common
from jaxserve.envs.base import as_size
from jaxserve.envs import autoscaling as AS
from jaxserve.envs.batching import Batching
from jaxserve.envs.routing import DEFAULT_SHAPING_GAMMA, Routing

_REGISTRY: dict[str, Callable] = {}


def register(name: str):
    """Decorator adding an environment builder `builder(**overrides) -> (env, params)`."""
    def deco(fn):
        if name in _REGISTRY:
            raise ValueError(f"environment {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn
    return deco


def registered_envs() -> tuple[str, ...]:
    """Names accepted by `make`."""
    return tuple(sorted(_REGISTRY))


def make(name: str, **overrides):
    """Builds environment `name` with its default scenario and `overrides`.

    Returns:
      (env, params): a gymnax `Environment` and its `ServingParams`.
    Raises:
      ValueError: unknown name, unknown override, or an invalid value (naming the field).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(registered_envs())}")
    return _REGISTRY[name](**overrides)


# A dropped request costs as much as this many seconds in the system: far above any latency
# the default scenarios produce, so dropping is never cheaper than serving (Routing-v0,
# Batching-v0; Autoscaling-v0 sets its own, also 600 s).
DEFAULT_DROP_PENALTY_S = 600.0
# Seconds of time-in-system per unit of (negative) reward in Routing-v0 and Batching-v0, chosen
# so that discounted returns (gamma 0.99) are O(1) for an unnormalised PPO (docs/training.md).
DEFAULT_LATENCY_SCALE = 1000.0

# LLM SLO targets (a choice, as in docs/continuous.md's study): time to first token <= 2 s and
# time per output token <= 0.1 s; an SLO miss costs 60 s of time-in-system in the SLO reward
# (a tenth of a drop, so shedding a request is never cheaper than serving it late).
DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.1
DEFAULT_SLO_MISS_S = 60.0

# Default profiles (see docs/profiles.md for the named, sourced ones).
DEFAULT_SIZE_EDGES = (128.0,)
DEFAULT_SIZE_VALUES = (48.0, 512.0)


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


def _static_sizes(queue_buffer, params):
    """(queue buffer, max batch) shapes for `params`, validated."""
    caps = int(np.max(np.asarray(params.gpus.queue_cap)))
    qb = caps if queue_buffer is None else as_size("queue_buffer", queue_buffer)
    mb = int(np.max(np.asarray(params.gpus.max_batch)))
    common.validate_params(params, qb, mb)
    return qb, mb


def routing_gpus() -> list[GPUProfile]:
    """Default Routing-v0 cluster: two fast and two slow replicas of Llama-2-70B.

    Fast: H100 x4 (tensor parallel); slow: A100 x2. Coefficients are fits to Splitwise's
    measured profiles (`core/profiles.py`, docs/profiles.md).
    """
    return [get_profile("fast")] * 2 + [get_profile("slow")] * 2


def routing_tokens() -> A.TokenDist:
    """Default Routing-v0 workload: 80% short (256 -> 32 tokens), 20% long (1024 -> 512).

    A batch runs until its longest output is done, so a short request batched with a long one
    waits ~15x longer than alone: head-of-line blocking is what a router must avoid.
    """
    return A.bimodal_tokens(long_frac=0.2, short=(256, 32), long=(1024, 512), sigma=0.3,
                            max_prompt=8192, max_output=2048)


# What Routing-v0's routers see of a request's output length by default (issue 25): a noisy
# prediction, never the true length or its true size class. `estimate = round(output *
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


def _bursty_arrivals(mean_rate: float, ratio: float = 5.0, high_frac: float = 0.15,
                     mean_high_s: float = 60.0) -> A.ArrivalProcess:
    """Two-phase MMPP of mean `mean_rate` (req/s): a fraction `high_frac` of the time at
    `ratio` times the low phase's rate, high phases lasting `mean_high_s` on average."""
    low = mean_rate / (1.0 - high_frac + high_frac * ratio)
    leave_high = 1.0 / mean_high_s
    return A.mmpp([low, low * ratio], (leave_high * high_frac / (1.0 - high_frac), leave_high))


def short_bursts_tokens() -> A.TokenDist:
    """The `short_bursts` scenario's request mix: Routing-v0's two classes (32 and 512 output
    tokens, sigma 0.3), one prompt law for both (median 512 tokens, sigma 0.5), and a class
    mix per arrival phase: 40% long in the quiet phase, none in bursts.

    The prompt says nothing of the output length, as in real LLM traces: on Azure's 2023 LLM
    inference traces (/work/shared/traces/azure_llm_2023) the correlation of log prompt and
    log output is -0.005 (code, 8819 requests) and 0.087 (conversation, 19366; Pearson over
    every row, `np.corrcoef(np.log(ContextTokens), np.log(GeneratedTokens))`), while in the
    default mix (256- vs 1024-token prompts) the prompt gives the class away; so the noisy
    estimate is the router's only size signal here.
    """
    base = A.class_mixture([0.8, 0.2], [512, 512], [0.5, 0.5], [32, 512], [0.3, 0.3],
                           max_prompt=8192, max_output=2048)
    return A.with_phase_weights(base, [[0.6, 0.4], [1.0, 0.0]])


# Registered Routing-v0 scenarios, `make("Routing-v0", scenario=name)` (explicit overrides
# still win). Rates are fractions (`load`) of the cluster's full-batch capacity for the
# scenario's mix (`capacity`, req/s: `evaluation.capacity.service_capacity`; envs cannot
# import evaluation, so it is a number). All keep queue_buffer 64, so the scenarios whose
# parameters have equal shapes train in one program (docs/results.md (w)).
ROUTING_CAPACITY_DEFAULT = 2.163
ROUTING_CAPACITY_SHORT_BURSTS = 2.199
ROUTING_SCENARIOS = {
    "bursty": dict(
        load=0.6, capacity=ROUTING_CAPACITY_DEFAULT,
        reason="Bursty load: the default cluster and mix at mean load 0.6, 15% of the time "
               "in bursts at 5x the quiet rate (quiet phase load 0.38, bursts 1.9: overload), "
               "bursts lasting 60 s on average. SITA's partition is fitted for the mean rate; "
               "a router that reads the queues can shed a burst across groups.",
        overrides=lambda: dict(arrivals=_bursty_arrivals(0.6 * ROUTING_CAPACITY_DEFAULT))),
    "bursty_short_queues": dict(
        load=0.6, capacity=ROUTING_CAPACITY_DEFAULT,
        reason="As `bursty`, with 16 queue slots per GPU (a latency-oriented admission "
               "limit) instead of 64: bursts overflow queues, so where a router puts a "
               "request decides whether it is dropped.",
        overrides=lambda: dict(arrivals=_bursty_arrivals(0.6 * ROUTING_CAPACITY_DEFAULT),
                               gpus=[get_profile(t, queue_cap=16)
                                     for t in ("fast", "fast", "slow", "slow")],
                               queue_buffer=64)),
    "short_bursts": dict(
        load=0.6, capacity=ROUTING_CAPACITY_SHORT_BURSTS,
        reason="Non-stationary mix with realistic information: in the quiet phase 40% of "
               "requests are long; bursts (30% of the time, 3x the quiet rate, lasting 120 s "
               "on average) bring short requests only. Mean load 0.6 of capacity. Prompts "
               "say nothing of output length (as in Azure's LLM traces), so routers size "
               "requests by the noisy estimate alone. SITA is fitted to the average mix (17.5% "
               "long), which is wrong in both phases; a router that reads the queues can see "
               "when the fast GPUs hold no long requests and send short ones there.",
        overrides=lambda: dict(
            arrivals=_bursty_arrivals(0.6 * ROUTING_CAPACITY_SHORT_BURSTS, ratio=3.0,
                                      high_frac=0.3, mean_high_s=120.0),
            tokens=short_bursts_tokens())),
}


@register("Routing-v0")
def make_routing(gpus=None, queue_buffer=None, arrival_rate=None, arrivals=None,
                 shaping_gamma=DEFAULT_SHAPING_GAMMA, scenario=None, **kw):
    """Routing-v0: heterogeneous GPUs, bimodal short/long requests (head-of-line blocking).

    Defaults chosen so that a standard PPO (PureJaxRL's CartPole settings, MLP on the flat
    observation, no reward normalisation) learns on them (tests/test_learnable.py,
    docs/training.md): reward shaped with `shaping_gamma=0.99` (potential-based, see
    `Routing`; None turns it off), a drop costs `drop_penalty_s=600` s (15x the SLO, more
    than any latency the default load produces, so shedding is never cheaper than serving),
    rewards in units of `latency_scale=1000` s. With the shaping a step's reward is about
    minus the routed request's latency (plus the delay it adds to others) over 1000 s, so the
    discounted return over ~100 steps is O(1): PureJaxRL clips the gradient norm of actor and
    critic together, and value targets of hundreds (latency_scale 10 or 100) starve the actor.
    Routers (learned and heuristic alike) see a noisy output-length prediction
    (`estimate_mode=1`, `estimate_noise=1.0`: see `ROUTING_ESTIMATE_NOISE`), not the true
    size class; pass `estimate_mode=2` for that oracle. `scenario` names an entry of
    `ROUTING_SCENARIOS` (its overrides under the explicit ones).
    """
    if scenario is not None:
        if scenario not in ROUTING_SCENARIOS:
            raise ValueError(f"unknown Routing-v0 scenario {scenario!r}; registered: "
                             f"{sorted(ROUTING_SCENARIOS)}")
        given = dict(gpus=gpus, queue_buffer=queue_buffer, arrival_rate=arrival_rate,
                     arrivals=arrivals)
        for k, v in ROUTING_SCENARIOS[scenario]["overrides"]().items():
            if k in given:
                if given[k] is None and not (k == "arrivals" and arrival_rate is not None):
                    given[k] = v
            else:
                kw.setdefault(k, v)
        gpus, queue_buffer = given["gpus"], given["queue_buffer"]
        arrival_rate, arrivals = given["arrival_rate"], given["arrivals"]
    gpus = routing_gpus() if gpus is None else list(gpus)
    if arrivals is None and arrival_rate is None:
        arrival_rate = 2.0
    kw.setdefault("tokens", routing_tokens())
    # A long request alone takes ~15 s on a fast replica and ~29 s on a slow one.
    kw.setdefault("slo_s", 40.0)
    kw.setdefault("drop_penalty_s", DEFAULT_DROP_PENALTY_S)
    kw.setdefault("latency_scale", DEFAULT_LATENCY_SCALE)
    kw.setdefault("estimate_mode", ROUTING_ESTIMATE_MODE)
    kw.setdefault("estimate_noise", ROUTING_ESTIMATE_NOISE)
    params = build_params(gpus, arrivals=arrivals, arrival_rate=arrival_rate, **kw)
    qb, mb = _static_sizes(queue_buffer, params)
    env = Routing(num_gpus=len(gpus), queue_buffer=qb, max_batch=mb,
                  trace_len=params.trace.gap.shape[0], default=params,
                  shaping_gamma=shaping_gamma)
    return env, params


@register("Batching-v0")
def make_batching(gpus=None, queue_buffer=None, arrival_rate=None, arrivals=None, **kw):
    """Batching-v0: one GPU, Poisson arrivals, the agent decides each batch."""
    gpus = [get_profile("mid")] if gpus is None else list(gpus)
    if len(gpus) != 1:
        raise ValueError(f"Batching-v0 runs exactly one GPU, got {len(gpus)}")
    if arrivals is None and arrival_rate is None:
        # A full batch of 16 takes ~33 s on this replica (at most ~0.48 req/s): load ~0.7.
        arrival_rate = 0.35
    kw.setdefault("drop_penalty_s", DEFAULT_DROP_PENALTY_S)
    kw.setdefault("latency_scale", DEFAULT_LATENCY_SCALE)
    params = build_params(gpus, arrivals=arrivals, arrival_rate=arrival_rate, **kw)
    qb, mb = _static_sizes(queue_buffer, params)
    env = Batching(max_batch=mb, queue_buffer=qb,
                   trace_len=params.trace.gap.shape[0], default=params)
    env.check_params(params)
    return env, params


# Autoscaling-v0 defaults: a compressed day (2 h) of diurnal Poisson traffic, decided every
# 15 s (Kubernetes HPA's sync period); a replica of Llama-2-70B needs ~2 min to load.
AUTOSCALING_DEFAULTS = dict(control_interval_s=15.0, warmup_s=120.0, gpu_price=4.0,
                            latency_weight=1.0, slo_penalty_s=0.0, diurnal_amplitude=0.6,
                            diurnal_period_s=7200.0, diurnal_phase_s=0.0, initial_replicas=2,
                            action_mode=0, random_phase=0, random_initial=0,
                            invalid_penalty_s=0.0, price_spread=1.0, random_offset=0)


def scaling_params(serving: common.ServingParams, **scalars) -> AS.AutoscalingParams:
    """`AutoscalingParams` around `serving`, from `AUTOSCALING_DEFAULTS` and `scalars`."""
    unknown = set(scalars) - set(AS.SCALING_FIELDS)
    if unknown:
        raise ValueError(f"unknown Autoscaling-v0 parameter(s) {sorted(unknown)}; known: "
                         f"{sorted(AS.SCALING_FIELDS)}")
    values = {**AUTOSCALING_DEFAULTS, **scalars}
    return AS.AutoscalingParams(serving=serving, **{
        k: common.scalar_leaf(k, values[k], AS.SCALING_FIELDS[k]) for k in AS.SCALING_FIELDS})


@register("Autoscaling-v0")
def make_autoscaling(gpu=None, gpus=None, max_replicas=8, queue_buffer=None, arrival_rate=None,
                     arrivals=None, history_len=64, workload="diurnal", load=None, **kw):
    """Autoscaling-v0: up to 8 A100 replicas of Llama-2-70B under a diurnal load.

    `workload` names a trace-based workload instead (`envs.autoscaling_workloads`), at offered
    load `load` of the whole cluster.
    """
    from jaxserve.envs.autoscaling_workloads import workload_overrides

    if gpu is not None and gpus is not None:
        raise ValueError("give either gpu= (one profile for every slot) or gpus=, not both")
    if gpus is None:
        gpus = [get_profile("mid") if gpu is None else gpu] * as_size("max_replicas",
                                                                       max_replicas)
    gpus = list(gpus)
    max_replicas = len(gpus)
    named = workload_overrides(workload, gpus, load)
    if named and (arrivals is not None or arrival_rate is not None or "trace" in kw
                  or "tokens" in kw):
        raise ValueError(f"workload={workload!r} sets the arrivals and tokens itself; do not "
                         f"also pass arrivals, arrival_rate, trace or tokens")
    if "arrivals" in named:
        arrivals = named.pop("arrivals")
    for k, v in named.items():
        kw.setdefault(k, v)
    if kw.get("trace") is not None:
        # One episode replays the whole trace (it terminates when the trace has drained),
        # whether the trace came from a named workload or from `trace=`.
        kw.setdefault("max_steps_in_episode", 1_000_000)
    scalars = {k: kw.pop(k) for k in list(kw) if k in AS.SCALING_FIELDS}
    if "trace" in kw and kw["trace"] is not None:
        scalars.setdefault("diurnal_amplitude", 0.0)
    if arrivals is None and arrival_rate is None and kw.get("trace") is None:
        # Mean 1.2 req/s: 4-5 replicas hold the mean latency under the SLO at the mean rate,
        # 7-8 at the peak (amplitude 0.6); docs/scaling.md has the fixed-count measurements.
        arrival_rate = 1.2
    if arrivals is None and arrival_rate is None:
        arrival_rate = 1.0  # unused: the trace replaces the arrival process
    kw.setdefault("tokens", routing_tokens())
    kw.setdefault("slo_s", 60.0)
    # A dropped request costs 10 minutes: shedding load must not be a way to save GPUs.
    kw.setdefault("drop_penalty_s", 600.0)
    kw.setdefault("latency_scale", 1000.0)
    kw.setdefault("max_steps_in_episode", 480)
    serving = build_params(gpus, arrivals=arrivals, arrival_rate=arrival_rate, **kw)
    qb, mb = _static_sizes(queue_buffer, serving)
    params = scaling_params(serving, **scalars)
    env = AS.Autoscaling(max_replicas=max_replicas, queue_buffer=qb, max_batch=mb,
                         trace_len=serving.trace.gap.shape[0], history_len=history_len,
                         default=params)
    env.check_params(params)
    return env, params


def llm_routing_replicas():
    """Default LLMRouting-v0 cluster: two OPT-13B replicas on A100-80GB, two on A100-40GB.

    Same DistServe iteration-time fit; the 40 GB cards hold a fifth of the KV cache
    (`core/replica.py`, docs/continuous.md), so memory, not speed, separates them.
    """
    from jaxserve.core.replica import replica_profile

    return [replica_profile("opt13b-a100-80g")] * 2 + [replica_profile("opt13b-a100-40g")] * 2


@register("LLMRouting-v0")
def make_llm_routing(replicas=None, queue_buffer=None, max_seqs=None, arrival_rate=None,
                     arrivals=None, shaping_gamma=DEFAULT_SHAPING_GAMMA,
                     reward="time_in_system", **kw):
    """LLMRouting-v0: heterogeneous continuous-batching replicas (KV cache, preemption).

    `replicas`: list of `ReplicaProfile`; `max_seqs` (static running slots) defaults to the
    largest `max_seqs` of the replicas, `queue_buffer` to the largest `queue_cap`.
    Reward defaults as Routing-v0's, for the same reason (a standard PPO learns on them,
    tests/test_llm_learnable.py): shaped with `shaping_gamma=0.99` (None turns it off), a
    drop costs `drop_penalty_s=600` s, rewards in units of `latency_scale=1000` s.
    `reward="slo"` charges TTFT/TPOT SLO misses instead of time-in-system (`LLMRouting`).
    """
    from jaxserve.core.replica import stack_replicas
    from jaxserve.envs.llm_routing import LLMRouting

    replicas = llm_routing_replicas() if replicas is None else list(replicas)
    prof = stack_replicas(replicas)
    if arrivals is None and arrival_rate is None:
        arrival_rate = 16.0
    kw.setdefault("tokens", routing_tokens())
    kw.setdefault("slo_s", 20.0)
    kw.setdefault("drop_penalty_s", DEFAULT_DROP_PENALTY_S)
    kw.setdefault("latency_scale", DEFAULT_LATENCY_SCALE)
    params = build_params(prof, arrivals=arrivals, arrival_rate=arrival_rate, **kw)
    qb = (int(np.max(np.asarray(prof.queue_cap))) if queue_buffer is None
          else as_size("queue_buffer", queue_buffer))
    ms = int(np.max(np.asarray(prof.max_seqs))) if max_seqs is None else as_size("max_seqs",
                                                                                   max_seqs)
    env = LLMRouting(num_replicas=len(replicas), queue_buffer=qb, max_seqs=ms,
                     trace_len=params.trace.gap.shape[0], default=params,
                     shaping_gamma=shaping_gamma, reward=reward)
    env.check_params(params)
    return env, params


def prefix_replicas():
    """Default LLMPrefixRouting-v0 cluster: four OPT-13B replicas on A100-40GB (DistServe's
    iteration-time fit, `core/replica.py`), KV memory counted in 128-token blocks: the
    40 GB card's 10,112 tokens (`kv_blocks_for(..., block_size=128)` = 79 blocks), so a
    long-context prompt (median ~5k tokens here) takes half a replica's cache and memory
    binds. 128-token blocks (vLLM uses 16) keep the prefix engine's `O(M^2)` lookup cheap;
    the cost is rounding up to 127 tokens per request where vLLM wastes at most 15. 16
    running and 16 waiting slots (scheduler settings, not measurements)."""
    from jaxserve.core.replica import _OPT13B_WEIGHTS_GB, kv_blocks_for, replica_profile

    kv = kv_blocks_for(40, 5120, 40.0, _OPT13B_WEIGHTS_GB, block_size=PREFIX_BLOCK_SIZE)
    return [replica_profile("opt13b-a100-40g", block_size=PREFIX_BLOCK_SIZE, kv_blocks=kv,
                            max_seqs=16, queue_cap=16)] * 4


PREFIX_BLOCK_SIZE = 128
PREFIX_REQUESTS = 512  # requests of the default synthetic trace (one episode)
PREFIX_SEED = 0


def prefix_workload(n_requests: int = PREFIX_REQUESTS, seed: int = PREFIX_SEED):
    """Default LLMPrefixRouting-v0 workload: `traces.prefix_synthetic.generate_shared_prefix`
    (host numpy, seed 0) with Mooncake-like sessions (its defaults: one 512-token system
    prompt, multi-turn conversations, first-turn user input median 5,500 tokens) except
    `max_prompt = 8192` (a session ends when its conversation outgrows a replica's cache)
    and `session_rate = PREFIX_SESSION_RATE` sessions/s, at which four default replicas'
    KV caches are mostly full (the registry test checks evictions occur)."""
    from jaxserve.traces.prefix_synthetic import SharedPrefixConfig, generate_shared_prefix

    cfg = SharedPrefixConfig(session_rate=PREFIX_SESSION_RATE, max_prompt=8192)
    return generate_shared_prefix(int(n_requests), cfg, seed=int(seed))


PREFIX_SESSION_RATE = 0.5


# Not registered (`jaxserve.make` does not build it): every registered env must be learnable by a
# standard PPO as it is, and on this one a minimal PPO trails the best router after 1M steps
# (`python -m tests.prefix_learnability`; with prefix caching on it steps at ~2,350
# env-steps/s on a 2-core CPU at 256 envs). Built by this function.
def make_llm_prefix_routing(replicas=None, trace=None, queue_buffer=None, max_seqs=None,
                            shaping_gamma=DEFAULT_SHAPING_GAMMA, reward="time_in_system",
                            caching=True, tree_nodes=None, tree_depth=None, **kw):
    """LLMPrefixRouting-v0 (experimental, not in `jaxserve.make`'s registry: a standard PPO
    does not yet learn it to the best router's level): LLMRouting-v0's class with automatic prefix
    caching on (`LLMRoutingStatic.prefix_blocks` = the largest `kv_blocks`), driven by a
    trace with prefix identity.

    `trace`: a `traces.prefix.PrefixTrace`, or a path to a Mooncake JSONL(.gz) file
    (`traces.mooncake.load_mooncake`); default `prefix_workload()` (512 synthetic
    shared-prefix requests, built on the host here). An episode replays the whole trace
    (`max_steps_in_episode` = its length unless given). `replicas` default
    `prefix_replicas()`; `caching=False` builds the same scenario without a prefix cache
    (LLMRouting-v0's engine; params still `PrefixRoutingParams`). `tree_nodes` and
    `tree_depth` pad the prefix tables (`continuous.prefix_tables`) so that traces of
    different trees share one program. Other keywords as LLMRouting-v0 (reward scalars).
    """
    import dataclasses

    from jaxserve.core import continuous as CB
    from jaxserve.core.replica import stack_replicas
    from jaxserve.envs.llm_routing import LLMRouting, PrefixRoutingParams
    from jaxserve.traces.prefix import PrefixTrace

    for bad in ("arrivals", "arrival_rate", "tokens"):
        if bad in kw:
            raise ValueError(f"LLMPrefixRouting-v0 replays a trace; {bad}= does not apply")
    if trace is None:
        trace = prefix_workload()
    elif isinstance(trace, (str, bytes)) or hasattr(trace, "__fspath__"):
        from jaxserve.traces.mooncake import load_mooncake
        trace = load_mooncake(trace)
    if not isinstance(trace, PrefixTrace):
        raise ValueError(f"trace must be a PrefixTrace or a Mooncake file path, got "
                         f"{type(trace).__name__}")
    replicas = prefix_replicas() if replicas is None else list(replicas)
    prof = stack_replicas(replicas)
    n = len(trace.trace.arrival_s)
    kw.setdefault("max_steps_in_episode", n)
    kw.setdefault("slo_s", 20.0)
    kw.setdefault("drop_penalty_s", DEFAULT_DROP_PENALTY_S)
    kw.setdefault("latency_scale", DEFAULT_LATENCY_SCALE)
    # The token distribution is unused with a trace but for the request features' scales
    # (log prompt / log max_prompt): its maxima cover the trace's.
    tr = trace.trace
    kw.setdefault("tokens", A.bimodal_tokens(
        long_frac=0.2, short=(256, 32), long=(1024, 512), sigma=0.3,
        max_prompt=max(8192, int(np.max(tr.prompt_tokens))),
        max_output=max(2048, int(np.max(tr.output_tokens)))))
    # A router sees a prediction of the output length, never the truth (as Routing-v0).
    kw.setdefault("estimate_mode", ROUTING_ESTIMATE_MODE)
    kw.setdefault("estimate_noise", ROUTING_ESTIMATE_NOISE)
    base = build_params(prof, arrival_rate=1.0, trace=trace.trace, **kw)
    tree = trace.tree
    node = np.asarray(trace.node, np.int64)
    if node.shape != (n,):
        raise ValueError(f"trace.node must have one entry per request ({n}), got {node.shape}")
    tables = CB.prefix_tables(tree.parent, tree.depth, tree.block_tokens, tree_nodes,
                              tree_depth)
    params = PrefixRoutingParams(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
        node=jnp.asarray(node, jnp.int32), tables=tables)
    qb = (int(np.max(np.asarray(prof.queue_cap))) if queue_buffer is None
          else as_size("queue_buffer", queue_buffer))
    ms = int(np.max(np.asarray(prof.max_seqs))) if max_seqs is None else as_size("max_seqs",
                                                                                   max_seqs)
    blocks = int(np.max(np.asarray(prof.kv_blocks))) if caching else 0
    env = LLMRouting(num_replicas=len(replicas), queue_buffer=qb, max_seqs=ms,
                     trace_len=params.trace.gap.shape[0], default=params,
                     shaping_gamma=shaping_gamma, reward=reward, prefix_blocks=blocks)
    env.check_params(params)
    return env, params


@register("LLMAutoscaling-v0")
def make_llm_autoscaling(replicas=None, max_replicas=4, queue_buffer=None, max_seqs=None,
                         arrival_rate=None, arrivals=None, history_len=64, **kw):
    """LLMAutoscaling-v0: Autoscaling-v0 over continuous-batching LLM replicas.

    `replicas`: list of `ReplicaProfile`, one per slot (default: `max_replicas` OPT-13B
    A100-80GB replicas with `max_seqs = queue_cap = 16`, about 3.4 req/s each on Routing-v0's
    token mix by `core.continuous_load`). Diurnal Poisson arrivals, mean 6 req/s (peak 9.6:
    three replicas at the mean, all four near the peak), each episode from a random time of
    day (`random_phase=1`); warm-up 60 s; `latency_scale=1000` s and `drop_penalty_s=600` s
    as the other environments. Other keywords as
    Autoscaling-v0's scaling and serving parameters (`envs/llm_autoscaling.py`).
    """
    from jaxserve.core.replica import replica_profile, stack_replicas
    from jaxserve.envs.llm_autoscaling import LLMAutoscaling

    if replicas is None:
        replicas = [replica_profile("opt13b-a100-80g", max_seqs=16, queue_cap=16)] * as_size(
            "max_replicas", max_replicas)
    replicas = list(replicas)
    prof = stack_replicas(replicas)
    scalars = {k: kw.pop(k) for k in list(kw) if k in AS.SCALING_FIELDS}
    scalars.setdefault("warmup_s", 60.0)
    # Each episode starts at a random time of day, so vmapped episodes are not in lockstep
    # (issue 25; Autoscaling-v0's `random_phase`).
    scalars.setdefault("random_phase", 1)
    if kw.get("trace") is not None:
        scalars.setdefault("diurnal_amplitude", 0.0)
    if arrivals is None and arrival_rate is None:
        arrival_rate = 6.0
    kw.setdefault("tokens", routing_tokens())
    kw.setdefault("slo_s", 20.0)
    kw.setdefault("drop_penalty_s", 600.0)
    kw.setdefault("latency_scale", 1000.0)
    # A replayed trace runs to its end (termination), not to the synthetic episode's 480
    # intervals: the trace's default must be set first, or the synthetic one wins.
    if kw.get("trace") is not None:
        kw.setdefault("max_steps_in_episode", 1_000_000)
    kw.setdefault("max_steps_in_episode", 480)
    serving = build_params(prof, arrivals=arrivals, arrival_rate=arrival_rate, **kw)
    qb = (int(np.max(np.asarray(prof.queue_cap))) if queue_buffer is None
          else as_size("queue_buffer", queue_buffer))
    ms = int(np.max(np.asarray(prof.max_seqs))) if max_seqs is None else as_size("max_seqs",
                                                                                   max_seqs)
    params = scaling_params(serving, **scalars)
    env = LLMAutoscaling(max_replicas=len(replicas), queue_buffer=qb, max_batch=ms,
                         trace_len=serving.trace.gap.shape[0], history_len=history_len,
                         default=params)
    env.check_params(params)
    return env, params
