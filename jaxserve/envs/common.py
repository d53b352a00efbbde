"""What the serving environments share: parameters, request sources, validation, features.

Static configuration (shapes: number of GPUs, queue buffer, trace window length) is a frozen
dataclass on the environment instance (`envs.base.StaticConfig`); everything a user may sweep
(GPU coefficients, batch limits, arrival rates, token distributions, SLO, reward weights,
episode length) is an array leaf of `ServingParams`, so `vmap` over params needs no recompile.

`ServingParams`' fields carry the defaults every environment shares (gymnax's `EnvParams()`
pattern); an environment's own defaults are a dict of overrides beside its builder (e.g.
`envs.routing.ROUTING_DEFAULTS`), and `envs.defaults.build_params` assembles the two with
the caller's keywords (docs/index.md, "Where defaults live").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.core import arrivals as A
from jaxserve.core.queues import Request
from jaxserve.core.replica import ReplicaProfile, validate_replica
from jaxserve.core.sources import TraceArrays
from jaxserve.core.types import (INT32_MAX, MAX_SECONDS, MAX_TOKENS, GPUProfile,
                                 check_int_array, numeric_array, validate_profile)


# Defaults every registered environment shares (the fields of `ServingParams` below).
# A dropped request costs as much as this many seconds in the system: far above any latency
# the default scenarios produce, so dropping is never cheaper than serving.
DEFAULT_DROP_PENALTY_S = 600.0
# Seconds of time-in-system per unit of (negative) reward, chosen so that discounted returns
# (gamma 0.99) are O(1) for an unnormalised PPO (docs/training.md).
DEFAULT_LATENCY_SCALE = 1000.0
# LLM SLO targets (a choice, as in docs/continuous.md's study): time to first token <= 2 s and
# time per output token <= 0.1 s; an SLO miss costs 60 s of time-in-system in the SLO reward
# (a tenth of a drop, so shedding a request is never cheaper than serving it late).
DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.1
DEFAULT_SLO_MISS_S = 60.0
# Output-length classes (tokens): one edge, a short and a long class's representative length.
DEFAULT_SIZE_EDGES = (128.0,)
DEFAULT_SIZE_VALUES = (48.0, 512.0)


def _array_default(values):
    """A float32 array field's default (a fresh array per instance)."""
    return struct.field(default_factory=lambda: jnp.asarray(values, jnp.float32))


@struct.dataclass(kw_only=True)
class ServingParams:
    """Vmappable parameters of a serving environment.

    The cluster (`gpus`), the workload (`arrivals`, `tokens`) and `trace` have no default
    (each environment's builder chooses them); every other field defaults to the value all
    registered environments share, overridden per environment by its builder's defaults dict
    (`envs.routing.ROUTING_DEFAULTS`, ...). Keyword-only. The scalar defaults are Python
    numbers, as gymnax's `EnvParams()`; `envs.defaults.build_params` casts every scalar
    field to its dtype (`SCALAR_FIELDS`), so params built by `jaxserve.make` hold arrays.

    Attributes:
      gpus: the cluster's GPU profiles, `(num_gpus,)` leaves.
      arrivals: arrival process (MMPP; Poisson is one phase). Unused when `trace` has rows.
      tokens: token-length distribution. Unused when `trace` has rows.
      estimate_mode: what schedulers see of output lengths: 0 exact, 1 noisy, 2 size class
        (of the true length: an oracle bit). Default 2; Routing-v0 and LLMPrefixRouting-v0
        default to 1 (a real router has only a prediction). int32.
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
    estimate_mode: jax.Array = A.ESTIMATE_CLASS
    estimate_noise: jax.Array = 0.5
    size_edges: jax.Array = _array_default(DEFAULT_SIZE_EDGES)
    size_values: jax.Array = _array_default(DEFAULT_SIZE_VALUES)
    slo_s: jax.Array = 10.0
    latency_scale: jax.Array = DEFAULT_LATENCY_SCALE
    drop_penalty_s: jax.Array = DEFAULT_DROP_PENALTY_S
    time_scale: jax.Array = 10.0
    max_steps_in_episode: jax.Array = 512
    slo_ttft_s: jax.Array = DEFAULT_SLO_TTFT_S
    slo_tpot_s: jax.Array = DEFAULT_SLO_TPOT_S
    slo_miss_s: jax.Array = DEFAULT_SLO_MISS_S
    trace: TraceArrays


SCALAR_FIELDS = {
    "estimate_mode": jnp.int32, "estimate_noise": jnp.float32, "slo_s": jnp.float32,
    "latency_scale": jnp.float32, "drop_penalty_s": jnp.float32, "time_scale": jnp.float32,
    "max_steps_in_episode": jnp.int32, "slo_ttft_s": jnp.float32, "slo_tpot_s": jnp.float32,
    "slo_miss_s": jnp.float32,
}
# Upper bounds of the float scalars: times in seconds at most `MAX_SECONDS`; the noisy
# estimate multiplies an output by `exp(estimate_noise * z)`, |z| <= 5.4 (float32 uniforms),
# so a sigma of 4 keeps it below 2^24 * e^21.6 ~ 4e16, finite. `latency_scale` divides the
# reward: at least `MIN_LATENCY_SCALE` keeps `cost / latency_scale` finite for any cost the
# bounded times and counts produce (< 1e30).
SCALAR_MAX = {"estimate_noise": 4.0, "slo_s": MAX_SECONDS, "latency_scale": MAX_SECONDS,
              "drop_penalty_s": MAX_SECONDS, "time_scale": MAX_SECONDS}
MIN_LATENCY_SCALE = 1e-6
# Arrivals one event loop may process between two rebases of its clock, on average, at the
# worst-case horizon (`check_arrival_horizon`).
MAX_ARRIVALS_PER_HORIZON = 2 ** 23


def scalar_leaf(name: str, value, dtype, where: str = "params") -> jax.Array:
    """`value` as a scalar-field leaf of `dtype`, refusing what a cast would silently change.

    Strings and other non-numbers are refused; an int32 field takes integers only (an
    integral float such as `512.0` is accepted; `2.5`, NaN, booleans and values outside int32
    are refused). Range checks are the validators' (`validate_params`).

    Raises:
      ValueError: naming `where.name` (`name` alone when `where` is empty).
    """
    label = f"{where}.{name}" if where else name
    if dtype == jnp.int32:
        return jnp.asarray(check_int_array(value, label, -INT32_MAX - 1, INT32_MAX), jnp.int32)
    a = numeric_array(value, label)
    if a.dtype.kind == "b":
        raise ValueError(f"{label} must be a number, got {value!r}")
    return jnp.asarray(a, dtype)


def check_token_headroom(params: "ServingParams", block_size, slots: int,
                         where: str = "params") -> None:
    """Raises ValueError unless the continuous engine's int32 token sums cannot overflow.

    `scheduler.schedule` sums the tokens of up to `slots` requests (running, or the front
    of the queue) and rounds up to blocks of `block_size`; the largest request this
    configuration can produce (`max_prompt + max_output`, or a trace's largest row) times
    `slots + 1`, plus a block, must fit int32.
    """
    tr = params.trace
    n = int(np.asarray(tr.length))
    if n > 0:
        biggest = float(np.max(np.asarray(tr.prompt, np.float64)[:n]
                               + np.asarray(tr.output, np.float64)[:n]))
        what = f"{where}.trace (largest prompt + output)"
    else:
        biggest = float(np.max(np.asarray(params.tokens.max_prompt, np.float64)
                               + np.asarray(params.tokens.max_output, np.float64)))
        what = f"{where}.tokens.max_prompt + max_output"
    b = float(np.max(np.asarray(block_size)))
    if (slots + 1) * (biggest + b) > INT32_MAX:
        raise ValueError(f"{what} = {biggest:.0f} tokens is too large for {slots} running "
                         f"slots: (slots + 1) * (tokens + block_size) must be <= {INT32_MAX} "
                         f"(the engine's int32 token sums)")


def check_arrival_horizon(arrivals: A.ArrivalProcess, horizon_s: float, where: str,
                          what: str) -> None:
    """Raises ValueError if `arrivals` is too fast for an event loop spanning `horizon_s` s.

    A loop that advances a float32 clock `t` by each arrival gap moves it only when the gap
    exceeds half a unit in the last place of `t` (<= `horizon_s * 2^-24`). With every phase
    rate `r` satisfying `r * horizon_s <= MAX_ARRIVALS_PER_HORIZON = 2^23`, a gap is below
    `horizon_s * 2^-23` with probability `1 - exp(-r * horizon_s * 2^-23) <= 1 - 1/e < 0.64`,
    so each arrival advances the clock with probability > 0.36 and the loop reaches its
    horizon after about `r * horizon_s <= 2^23` arrivals (the horizon is a worst case: most
    loops end far sooner). Faster rates (e.g. 1e30 req/s, where
    `t + gap == t` for every gap) would spin forever and are refused.
    """
    r = float(np.max(np.asarray(arrivals.rates, np.float64)))
    if r * float(horizon_s) > MAX_ARRIVALS_PER_HORIZON:
        raise ValueError(
            f"{where}.rates (make's arrival_rate= or arrivals=): a rate of {r:g} req/s over "
            f"{what} ({float(horizon_s):g} s) is "
            f"{r * float(horizon_s):.3g} arrivals per event loop; at most "
            f"{MAX_ARRIVALS_PER_HORIZON} are accepted (float32 time must advance with each "
            f"gap): lower the arrival rate")


def static_service_bound(gpus: GPUProfile, tokens: A.TokenDist) -> np.ndarray:
    """Upper bound (s) of one static batch's service time per GPU, `(num_gpus,)` float64.

    `docs/contract_static.md`'s `T(S)` with `|S| = max_batch` requests of `max_prompt` and
    `max_output` tokens (every coefficient is >= 0, so `T` grows with each).
    """
    g = {f: np.asarray(getattr(gpus, f), np.float64) for f in
         ("c0", "alpha", "alpha2", "beta", "gamma", "delta", "max_batch")}
    p = float(np.max(np.asarray(tokens.max_prompt, np.float64)))
    o = float(np.max(np.asarray(tokens.max_output, np.float64)))
    b = g["max_batch"]
    return (g["c0"] + g["alpha"] * b * p + g["alpha2"] * b * p * p
            + o * (g["beta"] + g["gamma"] * b + g["delta"] * b * p))


def discrete_action(action, n: int):
    """A `Discrete(n)` action as an index, and whether it was invalid (inside jit).

    Valid actions are integers in `[0, n)`. Anything else is mapped deterministically and
    flagged: an integer outside the range is clipped into it; a float action is invalid
    unless finite and integral, and maps to `clip(floor(a), 0, n - 1)` with NaN -> 0,
    +inf -> n - 1 and -inf -> 0 (so 1.7 -> 1, flagged; 2.0 -> 2, valid).

    Returns:
      (index int32 in `[0, n)`, invalid bool).
    """
    a = jnp.asarray(action)
    if jnp.issubdtype(a.dtype, jnp.floating):
        finite = jnp.isfinite(a)
        f = jnp.clip(jnp.nan_to_num(a, nan=0.0, posinf=n - 1, neginf=0.0), 0, n - 1)
        idx = jnp.floor(f).astype(jnp.int32)
        invalid = ~finite | (a != jnp.floor(a)) | (a < 0) | (a > n - 1)
        return idx, invalid
    a = a.astype(jnp.int32) if a.dtype != jnp.int32 else a
    return jnp.clip(a, 0, n - 1), (a < 0) | (a >= n)


def validate_serving_profiles(prof, queue_buffer: int, max_batch: int | None = None,
                              num_gpus: int | None = None, where: str = "params.gpus") -> None:
    """Host-side checks of the per-replica profiles `prof` (`(R,)` leaves) against an
    environment's static sizes: each profile's own rules (`types.validate_profile` for a
    `GPUProfile`, `replica.validate_replica` for a `ReplicaProfile`), `R == num_gpus`,
    batch limits within the static slots `max_batch`, queue caps within `queue_buffer`.
    Raises ValueError naming the field."""
    replicas = isinstance(prof, ReplicaProfile)
    if replicas:
        validate_replica(prof, where=where)
    else:
        validate_profile(prof, where=where)
    shape = np.shape(prof.c0)
    if num_gpus is not None and shape[-1:] != (num_gpus,):
        unit = "replicas" if replicas else "GPUs"
        raise ValueError(f"{where} has {shape[-1:] or 'no'} {unit}; the environment has "
                         f"{num_gpus}")
    if replicas:
        ms = np.asarray(prof.max_seqs)
        if max_batch is not None and np.any(ms > max_batch):
            raise ValueError(f"{where}.max_seqs {ms} exceeds the static running slots "
                             f"({max_batch}); rebuild the environment with a larger max_seqs, "
                             f"or give the replicas max_seqs <= {max_batch} (e.g. "
                             f"replicas=[r.replace(max_seqs={max_batch}) for r in replicas])")
    else:
        mb = np.asarray(prof.max_batch)
        if max_batch is not None and max_batch < queue_buffer and np.any(mb > max_batch):
            raise ValueError(f"{where}.max_batch {mb} exceeds the environment's static "
                             f"max_batch ({max_batch}); rebuild it with a larger max_batch")
    if np.any(np.asarray(prof.queue_cap) > queue_buffer):
        raise ValueError(f"{where}.queue_cap {np.asarray(prof.queue_cap)} exceeds the "
                         f"static queue buffer ({queue_buffer}); pass a larger queue_buffer")


def validate_params(params: ServingParams, queue_buffer: int, max_batch: int | None = None,
                    num_gpus: int | None = None, where: str = "params") -> None:
    """Host-side checks of a `ServingParams` against an environment's static sizes.

    `params.gpus` is checked as the profile type it holds: a `GPUProfile` (static batching;
    `max_batch` is then the static batch slots) or a stacked `ReplicaProfile` (continuous
    batching; `max_batch` is then the static running slots every `max_seqs` must fit).
    `where` names `params` in the messages (e.g. "params.serving"). Raises ValueError naming
    the field.
    """
    validate_serving_profiles(params.gpus, queue_buffer, max_batch, num_gpus, f"{where}.gpus")
    if np.asarray(params.trace.length) == 0:
        A.validate_arrivals(params.arrivals, where=f"{where}.arrivals")
        A.validate_tokens(params.tokens, where=f"{where}.tokens")
        w = np.asarray(params.tokens.weights)
        if w.ndim == 2 and w.shape[0] != params.arrivals.num_phases:
            raise ValueError(f"{where}.tokens.weights has {w.shape[0]} phase rows; the arrival "
                             f"process has {params.arrivals.num_phases} phases")
    for f, dtype in SCALAR_FIELDS.items():
        raw = numeric_array(getattr(params, f), f"{where}.{f}")
        if dtype == jnp.int32 and raw.dtype.kind not in "iu":
            check_int_array(raw, f"{where}.{f}", -INT32_MAX - 1, INT32_MAX)
        v = raw.astype(np.float64)
        if not np.all(np.isfinite(v)) or np.any(v < 0):
            raise ValueError(f"{where}.{f} must be finite and >= 0, got {v}")
        if f in SCALAR_MAX and np.any(v > SCALAR_MAX[f]):
            raise ValueError(f"{where}.{f} must be <= {SCALAR_MAX[f]:g}, got {v}")
    for f in ("latency_scale", "time_scale", "max_steps_in_episode"):
        if np.any(np.asarray(getattr(params, f)) <= 0):
            raise ValueError(f"{where}.{f} must be > 0, got {np.asarray(getattr(params, f))}")
    if np.any(np.asarray(params.latency_scale) < MIN_LATENCY_SCALE):
        raise ValueError(f"{where}.latency_scale must be >= {MIN_LATENCY_SCALE:g} (it divides "
                         f"the reward), got {np.asarray(params.latency_scale)}")
    if not np.all(np.isin(np.asarray(params.estimate_mode), (0, 1, 2))):
        raise ValueError(f"{where}.estimate_mode must be 0 (exact), 1 (noisy) or 2 (class), got "
                         f"{np.asarray(params.estimate_mode)}")
    edges = numeric_array(params.size_edges, f"{where}.size_edges").astype(np.float64)
    if edges.ndim != 1 or np.any(np.diff(edges) <= 0) or not np.all(np.isfinite(edges)):
        raise ValueError(f"{where}.size_edges must be a finite increasing 1-D array, got {edges}")
    values = numeric_array(params.size_values, f"{where}.size_values").astype(np.float64)
    if values.shape != (edges.shape[0] + 1,):
        raise ValueError(f"{where}.size_values must have one entry more than {where}.size_edges")
    if not np.all(np.isfinite(values)) or np.any(values < 1) or np.any(values > MAX_TOKENS):
        raise ValueError(f"{where}.size_values must be output lengths in [1, {MAX_TOKENS}] "
                         f"tokens, got {values}")


def draw_request(u: jax.Array, params: ServingParams, arrival, req_id, tokens=None,
                 phase=None) -> Request:
    """A request arriving at `arrival` (s), from four uniforms `u`.

    Tokens come from `params.tokens` (`u[0:3]`; in arrival phase `phase` when its class mix
    depends on the phase) unless given as a `(prompt, output)` pair (e.g. from a trace);
    `u[3]` draws the output estimate.
    """
    p, o = (A.tokens_from_uniforms(u[:3], params.tokens, phase) if tokens is None
            else tokens)
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
    return gap, draw_request(u, params, 0.0, req_id, phase=phase), phase, jnp.bool_(False)


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
    `core.static_load.expected_backlog`; LLMRouting-v0: `continuous_load.expected_backlog`)."""
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
    """Replaces scalar fields of `params`, cast to their dtypes by `scalar_leaf` (which refuses
    non-numbers and non-integers for int32 fields); ValueError for an unknown name."""
    names = {f.name for f in dataclasses.fields(params)}
    for k in kwargs:
        if k not in names:
            raise ValueError(f"unknown environment parameter {k!r}; known: {sorted(names)}")
    cast = {k: (scalar_leaf(k, v, SCALAR_FIELDS[k]) if k in SCALAR_FIELDS else v)
            for k, v in kwargs.items()}
    return params.replace(**cast)
