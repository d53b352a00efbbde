"""The rollout-serving workload: RL iterations whose rollouts come from an inference service.

One RL iteration submits `K` generation requests at once (all at time 0) with long-tailed
output lengths. They are routed, one after another, to `r` identical inference replicas by a
routing rule; every replica runs the engine's static batcher (`jaxserve.core.cluster`,
`docs/contract_static.md`) until it has served everything it holds. The generation phase ends when the
last request finishes (the *makespan*); a training phase of `train_s` seconds follows, during
which the replicas stay provisioned and idle. So, per iteration (seconds, hours):

    T(r)          = makespan(r) + train_s
    speedup(r)    = T(1) / T(r)                  (same requests: paired)
    gpu_hours(r)  = r * gpus_per_replica * T(r) / 3600     (inference replicas)
    trainer_hours = trainer_gpus * T(r) / 3600             (reported separately)

Routing rules (`RULES`, a traced int32 index dispatched with `lax.switch`, so one compiled
program serves every rule and `vmap` over rules works):

- `round_robin`: request `j` (submission order) to replica `j mod r`.
- `jsq`: fewest requests held (waiting plus running), ties to the lowest index.
- `least_work_left`: smallest `cluster.queued_work` (remaining time of the running batch plus
  the waiting requests' work shares, from output *estimates*).
- `lpt`: longest-processing-time-first: requests sorted by output estimate, descending (stable),
  each to the replica with the least `queued_work`. Each replica's FIFO queue is then sorted too,
  so its static batches hold requests of similar estimated length.
- `lpt_batch`: sorted as `lpt`, then cut into chunks of `c` consecutive requests (one static
  batch each), and LPT over *batches*: a chunk goes whole to the replica with the least
  predicted finish time (closed form `T(S)` of its planned batches, from estimates). The
  longest requests then share one batch instead of each dragging out a batch of short ones on
  every replica. `c = ceil(K / (r m))` with `m = ceil(K / (r B))`, the fewest batches the
  busiest replica can run (`B` = max_batch): about `r m` equal chunks, `m` per replica.

With all requests present at time 0 the batcher dispatches full batches at once and a partial
batch at the profile's `timeout` (or when its replica frees up past it); the engine's semantics
are kept as they are. Nothing here special-cases the timeout.

Continuous-batching replicas: give `make_params` a `ReplicaProfile` (or a named replica profile
such as "opt13b-a100-80g") instead of a `GPUProfile`, and every replica runs the
continuous-batching engine (`jaxserve.core.continuous`: vLLM-v1 FCFS, paged KV cache, recompute
preemption, chunked prefill) on the same request draws; the makespan is the last request's
finish. Rules `round_robin`, `jsq`, `least_work_left` and `lpt` apply, with the work estimate of
`core.continuous_load.queued_work`; `lpt_batch` plans static batches and is refused (ValueError
on the host; clipped to `lpt` under jit). In sweeps the `max_batch` axis is `max_seqs`, and
`batches` counts iterations. Requests that can never fit a replica's KV cache are dropped
(`dropped`), as the engine drops them.

Everything is pure JAX: `simulate_iteration` is jit- and vmap-able over keys, parameters
(including `num_replicas`, up to the static `max_replicas`) and rule indices; `sweep_raw` runs
replica counts x rules x batch sizes x seeds as ONE jitted program. Host functions
(`make_params`, `validate_params`, `simulate`, `sweep`) validate and raise ValueError naming
the field.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.core import arrivals as A
from jaxserve.core import engines
from jaxserve.core.profiles import get_profile
from jaxserve.core.queues import Request
from jaxserve.core.replica import NAMED_REPLICAS, REPLICA_BOOL_FIELDS, REPLICA_FLOAT_FIELDS, \
    REPLICA_INT_FIELDS, ReplicaProfile, replica_profile, validate_replica
from jaxserve.core.service import batch_service_time
from jaxserve.core.types import PROFILE_FLOAT_FIELDS, PROFILE_INT_FIELDS, GPUProfile, \
    validate_profile
from jaxserve.core.stats import percentiles_jax, t_halfwidth

RULES: tuple[str, ...] = ("round_robin", "jsq", "least_work_left", "lpt", "lpt_batch")
ROUND_ROBIN, JSQ, LEAST_WORK_LEFT, LPT, LPT_BATCH = range(len(RULES))
CONTINUOUS_RULES: tuple[str, ...] = RULES[:LPT + 1]  # lpt_batch plans static batches
ESTIMATE_MODES = {"exact": A.ESTIMATE_EXACT, "noisy": A.ESTIMATE_NOISY,
                  "class": A.ESTIMATE_CLASS}

# Size classes for the "class" estimate mode (tokens): <=512, <=2048, <=8192, longer.
DEFAULT_SIZE_EDGES = (512.0, 2048.0, 8192.0)
DEFAULT_SIZE_VALUES = (256.0, 1024.0, 4096.0, 12288.0)


@struct.dataclass
class RolloutParams:
    """Vmappable parameters of one rollout-serving iteration.

    Attributes:
      gpu: one replica's `GPUProfile` as scalar leaves (float32 coefficients, int32
        `max_batch` / `queue_cap`); every replica is identical, the leaves are broadcast.
        `queue_cap` must be >= K (a rollout is never dropped; `make_params` raises it).
        A `ReplicaProfile` (scalar leaves) selects continuous-batching replicas.
      tokens: `TokenDist` of (prompt, output) lengths (tokens).
      estimate_mode: what routing sees of output lengths: 0 exact, 1 noisy (lognormal,
        `estimate_noise`), 2 size class (`size_edges`, `size_values`). int32.
      estimate_noise: lognormal sigma of the noisy estimate. float32.
      size_edges: `(E,)` increasing class boundaries (tokens).
      size_values: `(E + 1,)` representative length of each class (tokens).
      train_s: seconds of training after the generation phase. float32.
      num_replicas: inference replicas `r` in use, `1 <= r <= max_replicas`. int32.
      trainer_gpus: GPUs of the trainer, for the separately reported trainer GPU-hours. float32.
      gpus_per_replica: GPUs per inference replica (a tensor-parallel group counts as its
        size); `gpu_hours` is in units of these GPUs. float32.
    """

    gpu: GPUProfile
    tokens: A.TokenDist
    estimate_mode: jax.Array
    estimate_noise: jax.Array
    size_edges: jax.Array
    size_values: jax.Array
    train_s: jax.Array
    num_replicas: jax.Array
    trainer_gpus: jax.Array
    gpus_per_replica: jax.Array


def default_tokens() -> A.TokenDist:
    """Long-tailed RL-rollout lengths: lognormal prompt (median 512, sigma 0.5, <= 8192) and
    output (median 1024, sigma 1.0, clipped to 16384 tokens; mean ~1.7k, p99 ~10k)."""
    return A.lognormal_tokens(512, 0.5, 1024, 1.0, max_prompt=8192, max_output=16384)


def scalar_profile(profile: GPUProfile | ReplicaProfile) -> GPUProfile | ReplicaProfile:
    """A profile with float32 / int32 (/ bool) scalar leaves (the form `RolloutParams.gpu`
    holds)."""
    floats, ints, bools = _fields(profile)
    kw = {f: jnp.asarray(getattr(profile, f), jnp.float32) for f in floats}
    kw.update({f: jnp.asarray(getattr(profile, f), jnp.int32) for f in ints})
    kw.update({f: jnp.asarray(getattr(profile, f), jnp.bool_) for f in bools})
    return profile.replace(**kw)


def is_continuous(params_or_profile) -> bool:
    """Whether rollouts are served by continuous-batching replicas (a `ReplicaProfile`)."""
    gpu = getattr(params_or_profile, "gpu", params_or_profile)
    return isinstance(gpu, ReplicaProfile)


def _fields(profile) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    if isinstance(profile, ReplicaProfile):
        return REPLICA_FLOAT_FIELDS, REPLICA_INT_FIELDS, REPLICA_BOOL_FIELDS
    return PROFILE_FLOAT_FIELDS, PROFILE_INT_FIELDS, ()


def _batch_field(params_or_profile) -> str:
    """The profile field the sweeps' `max_batch` axis sets: `max_batch`, or `max_seqs` for
    continuous-batching replicas."""
    return "max_seqs" if is_continuous(params_or_profile) else "max_batch"


def make_params(num_requests: int, *, gpu: str | GPUProfile | ReplicaProfile = "mid",
                tokens: A.TokenDist | None = None, estimate_mode: str | int = "noisy",
                estimate_noise: float = 0.5, size_edges: Sequence[float] = DEFAULT_SIZE_EDGES,
                size_values: Sequence[float] = DEFAULT_SIZE_VALUES, train_s: float = 0.0,
                num_replicas: int = 1, trainer_gpus: float = 0.0,
                gpus_per_replica: float = 1.0, **gpu_overrides) -> RolloutParams:
    """Builds `RolloutParams` for iterations of `num_requests` rollouts.

    Args:
      num_requests: K, rollouts per iteration (sizes the queues; the profile's `queue_cap` is
        raised to K if it is smaller, so no rollout is dropped).
      gpu: a named profile (`jaxserve.core.profiles.get_profile`, e.g. "mid") or a GPUProfile;
        or, for continuous-batching replicas, a named replica profile
        (`jaxserve.core.replica.replica_profile`, e.g. "opt13b-a100-80g") or a ReplicaProfile.
      tokens: token lengths (default `default_tokens()`).
      estimate_mode: "exact", "noisy" or "class" (or 0, 1, 2).
      gpu_overrides: profile fields to replace (e.g. `max_batch=32`, `timeout=0.0`; for a
        ReplicaProfile e.g. `max_seqs=32`, `kv_blocks=1000`).
      Other arguments: see `RolloutParams`.

    Raises:
      ValueError naming the field for any invalid value.
    """
    if isinstance(gpu, str) and gpu in NAMED_REPLICAS:
        profile = replica_profile(gpu, **gpu_overrides)
    elif isinstance(gpu, str):
        profile = get_profile(gpu, **gpu_overrides)
    elif isinstance(gpu, (GPUProfile, ReplicaProfile)):
        profile = gpu.replace(**gpu_overrides) if gpu_overrides else gpu
    else:
        raise ValueError(f"gpu must be a profile name, a GPUProfile or a ReplicaProfile, got "
                         f"{type(gpu).__name__}")
    _check_int(num_requests, "num_requests", 1)
    if int(np.max(np.asarray(profile.queue_cap))) < num_requests:
        profile = profile.replace(queue_cap=int(num_requests))
    if isinstance(estimate_mode, str):
        if estimate_mode not in ESTIMATE_MODES:
            raise ValueError(f"estimate_mode must be one of {sorted(ESTIMATE_MODES)}, "
                             f"got {estimate_mode!r}")
        estimate_mode = ESTIMATE_MODES[estimate_mode]
    _validate_gpu(profile, where="gpu")
    params = RolloutParams(
        gpu=scalar_profile(profile), tokens=default_tokens() if tokens is None else tokens,
        estimate_mode=jnp.asarray(estimate_mode, jnp.int32),
        estimate_noise=jnp.asarray(estimate_noise, jnp.float32),
        size_edges=jnp.asarray(size_edges, jnp.float32),
        size_values=jnp.asarray(size_values, jnp.float32),
        train_s=jnp.asarray(train_s, jnp.float32),
        num_replicas=jnp.asarray(num_replicas, jnp.int32),
        trainer_gpus=jnp.asarray(trainer_gpus, jnp.float32),
        gpus_per_replica=jnp.asarray(gpus_per_replica, jnp.float32))
    return params


def _check_int(v, name: str, lo: int, hi: int | None = None) -> int:
    try:
        ok = float(v) == int(v)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok or isinstance(v, bool):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {v}")
    return v


def _validate_gpu(profile, where: str) -> None:
    if isinstance(profile, ReplicaProfile):
        validate_replica(profile, where=where)
    else:
        validate_profile(profile, where=where)


def rule_index(rule: str | int, params: RolloutParams | None = None) -> int:
    """Index of a routing rule given by name (`RULES`) or index; ValueError if unknown, or if
    `params` has continuous-batching replicas and the rule is not in `CONTINUOUS_RULES`."""
    valid = CONTINUOUS_RULES if params is not None and is_continuous(params) else RULES
    if isinstance(rule, str):
        if rule not in valid:
            raise ValueError(f"unknown routing rule {rule!r}; valid: {', '.join(valid)}")
        return RULES.index(rule)
    return _check_int(rule, "rule", 0, len(valid) - 1)


def validate_params(params: RolloutParams, num_requests: int, max_replicas: int,
                    max_batch_bound: int | None = None) -> None:
    """Host-side checks of `params` against the static sizes; ValueError naming the field.

    Leaves may be batched (arrays) for vmap; every entry is checked.
    """
    if not isinstance(params, RolloutParams):
        raise ValueError(f"params must be RolloutParams, got {type(params).__name__}")
    k = _check_int(num_requests, "num_requests", 1)
    r = _check_int(max_replicas, "max_replicas", 1)
    if max_batch_bound is not None:
        _check_int(max_batch_bound, "max_batch_bound", 1)
    _validate_gpu(params.gpu, where="params.gpu")
    qc = np.asarray(params.gpu.queue_cap)
    if np.any(qc < k):
        raise ValueError(f"params.gpu.queue_cap ({qc}) must be >= num_requests ({k}): every "
                         f"rollout must fit a replica's queue (make_params raises it)")
    field = _batch_field(params)
    mb = np.asarray(getattr(params.gpu, field))
    if max_batch_bound is not None and max_batch_bound < k and np.any(mb > max_batch_bound):
        raise ValueError(f"params.gpu.{field} ({mb}) exceeds max_batch_bound "
                         f"({max_batch_bound})")
    nr = np.asarray(params.num_replicas)
    if not np.all(nr == np.round(nr)) or np.any(nr < 1) or np.any(nr > r):
        raise ValueError(f"params.num_replicas must be an integer in [1, max_replicas={r}], "
                         f"got {nr}")
    for f in ("train_s", "trainer_gpus", "gpus_per_replica", "estimate_noise"):
        v = np.asarray(getattr(params, f), np.float64)
        if not np.all(np.isfinite(v)) or np.any(v < 0):
            raise ValueError(f"params.{f} must be finite and >= 0, got {v}")
    if np.any(np.asarray(params.gpus_per_replica) <= 0):
        raise ValueError(f"params.gpus_per_replica must be > 0, got "
                         f"{np.asarray(params.gpus_per_replica)}")
    A.validate_tokens(params.tokens, where="params.tokens")
    if not np.all(np.isin(np.asarray(params.estimate_mode), (0, 1, 2))):
        raise ValueError("params.estimate_mode must be 0 (exact), 1 (noisy) or 2 (class), got "
                         f"{np.asarray(params.estimate_mode)}")
    edges = np.asarray(params.size_edges, np.float64)
    if edges.ndim != 1 or np.any(np.diff(edges) <= 0) or not np.all(np.isfinite(edges)):
        raise ValueError(f"params.size_edges must be a finite increasing 1-D array, got {edges}")
    if np.asarray(params.size_values).shape != (edges.shape[0] + 1,):
        raise ValueError("params.size_values must have one entry more than params.size_edges")


# ----------------------------------------------------------------------------- simulation


@struct.dataclass
class _Plan:
    """`lpt_batch`'s planned batches per replica (from estimates), `(R,)` each."""

    closed: jax.Array  # predicted seconds of the replica's closed (complete) batches
    size: jax.Array  # requests in the open batch, int32
    sum_p: jax.Array
    sum_p2: jax.Array
    max_e: jax.Array  # largest output estimate in the open batch (tokens)


def _open_time(plan: _Plan, gpus: GPUProfile) -> jax.Array:
    t = batch_service_time(gpus, plan.size, plan.sum_p, plan.sum_p2, plan.max_e)
    return jnp.where(plan.size > 0, t, 0.0)


def _plan_add(plan: _Plan, gpus: GPUProfile, g, req: Request, chunk) -> _Plan:
    """Adds `req` to replica `g`'s open batch, first closing it if it holds `chunk`."""
    full = plan.size[g] >= chunk
    closed = plan.closed.at[g].add(jnp.where(full, _open_time(plan, gpus)[g], 0.0))
    keep = jnp.where(full, 0.0, 1.0)
    return _Plan(closed=closed,
                 size=plan.size.at[g].set(jnp.where(full, 0, plan.size[g]) + 1),
                 sum_p=plan.sum_p.at[g].set(plan.sum_p[g] * keep + req.prompt),
                 sum_p2=plan.sum_p2.at[g].set(plan.sum_p2[g] * keep + req.prompt ** 2),
                 max_e=plan.max_e.at[g].set(jnp.maximum(plan.max_e[g] * keep, req.estimate)))


def _draw_requests(key, params: RolloutParams, num_requests: int):
    """K requests' (prompt, output, estimate, class) from one PRNG call (4 uniforms each, laid
    out as `jaxserve.envs.common.draw_request` uses them)."""
    u = A.uniforms(key, 4 * num_requests).reshape(num_requests, 4)
    prompt, output = jax.vmap(lambda ui: A.tokens_from_uniforms(ui[:3], params.tokens))(u)
    est, cls = A.estimate_from_uniform(u[:, 3], output, params.estimate_mode,
                                       params.estimate_noise, params.size_edges,
                                       params.size_values)
    return prompt, output, est, cls


def _requests(key, params: RolloutParams, num_requests: int, requests):
    """The K requests: drawn from `key`, or the given `(prompt, output, estimate)`."""
    if requests is None:
        return _draw_requests(key, params, num_requests)
    prompt, output, est = (jnp.broadcast_to(jnp.asarray(x, jnp.float32), (num_requests,))
                           for x in requests)
    return prompt, output, est, A.size_class(est, params.size_edges)


def _simulate(key, params: RolloutParams, rule, num_requests: int, max_replicas: int,
              max_batch_bound: int | None, per_request: bool, requests=None):
    """`simulate_iteration` on the engine `params.gpu` names (`engines.STATIC` for a
    `GPUProfile`, `engines.CONTINUOUS` for a `ReplicaProfile`): the K requests routed at time
    0 by `rule`, in submission order or (lpt, lpt_batch) by output estimate descending, then
    every replica drained. On continuous replicas routing happens before any iteration (the
    engine's event order: arrivals at an instant are queued before it is scheduled), and
    `lpt_batch`, which plans static batches, is clipped to `lpt`. `max_batch_bound` is the
    static dispatch window (`max_batch`) or number of running slots (`max_seqs`); default K."""
    engine = engines.CONTINUOUS if is_continuous(params) else engines.STATIC
    plans_batches = engine is engines.STATIC  # lpt_batch plans static batches
    K, R = num_requests, max_replicas
    f32 = jnp.float32
    gpus = jax.tree.map(lambda x: jnp.broadcast_to(x, (R,)), params.gpu)
    n = jnp.clip(params.num_replicas, 1, R).astype(jnp.int32)
    active = jnp.arange(R) < n
    last_rule = LPT_BATCH if plans_batches else LPT
    rule = jnp.clip(jnp.asarray(rule, jnp.int32), 0, last_rule)
    prompt, output, est, cls = _requests(key, params, K, requests)

    sorted_rule = (rule == LPT) | (rule == LPT_BATCH)
    order = jnp.where(sorted_rule, jnp.argsort(-est, stable=True),
                      jnp.arange(K, dtype=jnp.int32)).astype(jnp.int32)

    def argmin_active(x):
        return jnp.argmin(jnp.where(active, x, jnp.inf)).astype(jnp.int32)

    def rr(cl, plan, j):
        return (j % n).astype(jnp.int32)

    def jsq(cl, plan, j):
        return argmin_active(engine.held(cl).astype(f32))

    def lwl(cl, plan, j):
        return argmin_active(engine.work(cl, gpus))

    branches = [rr, jsq, lwl, lwl]  # lpt = least work left over the sorted order
    plan = None
    if plans_batches:
        b = jnp.maximum(params.gpu.max_batch, 1).astype(jnp.int32)
        # lpt_batch's chunk: the fewest batches the busiest replica can run is
        # m = ceil(K / (r B)); chunks of ceil(K / (r m)) give every replica about m equal
        # batches.
        per_replica = (K + n * b - 1) // (n * b)
        chunk = jnp.clip((K + n * per_replica - 1) // (n * per_replica), 1, b)

        def lpt_batch(cl, plan, j):
            open_ = active & (plan.size > 0) & (plan.size < chunk)
            return jnp.where(open_.any(), jnp.argmax(open_).astype(jnp.int32),
                             argmin_active(plan.closed + _open_time(plan, gpus)))

        branches.append(lpt_batch)
        zf = jnp.zeros((R,), f32)
        plan = _Plan(closed=zf, size=jnp.zeros((R,), jnp.int32), sum_p=zf, sum_p2=zf,
                     max_e=zf)

    window = K if max_batch_bound is None else max(1, min(int(max_batch_bound), K))
    cluster = engine.empty(R, K, window, with_ids=True)

    def step(carry, j):
        cl, plan, dropped = carry
        i = order[j]
        req = Request(arrival=f32(0.0), prompt=prompt[i], output=output[i], estimate=est[i],
                      size_class=cls[i], req_id=i)
        g = jax.lax.switch(rule, branches, cl, plan, j)
        cl, d = engine.route(cl, gpus, req, g)
        if plans_batches:
            plan = _plan_add(plan, gpus, g, req, chunk)
        return (cl, plan, dropped + d.astype(jnp.int32)), g

    (cluster, _, dropped), routed = jax.lax.scan(
        step, (cluster, plan, jnp.int32(0)), jnp.arange(K, dtype=jnp.int32))
    inf = jnp.float32(jnp.inf)
    cluster, m, _, log = engine.advance_logged(cluster, gpus, inf, inf, engine.empty_log(K))
    done, latency = engine.finished(log)  # arrival 0: latency = finish
    out = _result(params, m, n, done, latency, engine.batches_run(cluster).sum(), dropped)
    if not plans_batches:
        out["preemptions"] = cluster.preemptions.sum()
    if per_request:
        out["replica"] = jnp.zeros((K,), jnp.int32).at[order].set(routed)
        out["latency_s"] = jnp.where(done, latency, 0.0)
        if not plans_batches:
            out["ttft_s"] = jnp.where(done, log.ttft, 0.0)
        out["route_order"] = order
        out["prompt"], out["output"], out["estimate"] = prompt, output, est
    return out


def _result(params: RolloutParams, m, n, done, latency, batches, dropped) -> dict:
    """The iteration's summary (see `simulate_iteration`) from the engine's metrics and the
    per-request latencies (finish times: every request arrives at 0)."""
    f32 = jnp.float32
    completed = jnp.maximum(m.completed, 1)
    served = jnp.where(done, latency, jnp.nan)
    p50, p99 = percentiles_jax(served, (50.0, 99.0))  # the evaluation's definition (stats)

    makespan = m.elapsed.astype(f32)
    iteration = (makespan + params.train_s).astype(f32)
    nf = n.astype(f32)
    return {
        "makespan_s": makespan,
        "iteration_s": iteration,
        "gpu_hours": nf * params.gpus_per_replica * iteration / 3600.0,
        "trainer_gpu_hours": params.trainer_gpus * iteration / 3600.0,
        "mean_latency_s": jnp.where(m.completed > 0, m.latency_sum / completed, 0.0),
        "p50_latency_s": jnp.where(m.completed > 0, p50, 0.0),
        "p99_latency_s": jnp.where(m.completed > 0, p99, 0.0),
        "max_latency_s": jnp.where(m.completed > 0, jnp.nanmax(served), 0.0),
        "batches": batches,
        "busy_s": m.busy_time,
        "utilisation": m.busy_time / jnp.maximum(nf * iteration, 1e-30),
        "completed": m.completed,
        "dropped": dropped,
        "num_replicas": n,
    }


@partial(jax.jit, static_argnames=("num_requests", "max_replicas", "max_batch_bound",
                                   "per_request"))
def simulate_iteration(key: jax.Array, params: RolloutParams, rule, *, num_requests: int,
                       max_replicas: int, max_batch_bound: int | None = None,
                       per_request: bool = False, requests=None) -> dict:
    """Simulates one RL iteration: K rollouts at time 0, routed, served, then training.

    Pure JAX, jit/vmap-able over `key`, `params` (every leaf, `num_replicas` included) and
    `rule`. Nothing raises inside; validate on the host first (`validate_params`);
    `num_replicas` and `rule` are clipped to their ranges.

    Args:
      key: PRNG key; the K requests are drawn from it alone (same key, same requests, whatever
        the rule or replica count: comparisons are paired).
      params: `RolloutParams` (scalar leaves).
      rule: routing rule index into `RULES` (int32, may be traced).
      num_requests: K (static).
      max_replicas: static number of replica slots; replicas `>= num_replicas` get nothing.
      max_batch_bound: static bound of `max_batch` (the dispatch window), or of `max_seqs`
        (running slots) for continuous-batching replicas; default K.
      per_request: also return per-request arrays (in submission order): `replica` (int32),
        `latency_s`, `prompt`, `output`, `estimate` (tokens), and `route_order` (the request
        ids in the order they were routed, i.e. queued).
      requests: optional `(prompt, output, estimate)` token arrays `(K,)` (float, >= 1) that
        replace the draw from `params.tokens` (e.g. a previous iteration's real lengths); `key`
        is then unused.

    Returns:
      dict of scalars: `makespan_s` (time of the last completion, s), `iteration_s`
      (makespan + train_s, s), `gpu_hours` (r * gpus_per_replica * iteration_s / 3600, h),
      `trainer_gpu_hours` (trainer_gpus * iteration_s / 3600, h), `mean_latency_s`,
      `p50_latency_s`, `p99_latency_s` (`core.stats` percentiles: linear
      interpolation over served requests), `max_latency_s` (request latency = its
      finish time, s), `batches` (static batches run; iterations for continuous-batching
      replicas), `busy_s` (replica-seconds serving),
      `utilisation` (busy_s / (r * iteration_s)), `completed`, `dropped` (0 when
      queue_cap >= K; continuous replicas drop requests that never fit their KV cache),
      `num_replicas`; continuous-batching replicas also `preemptions`, and with
      `per_request` `ttft_s` (first-token time).
    """
    return _simulate(key, params, rule, num_requests, max_replicas, max_batch_bound,
                     per_request, requests)


def simulate(key: jax.Array, params: RolloutParams, rule: str | int = "round_robin", *,
             num_requests: int, max_replicas: int | None = None,
             per_request: bool = False, requests=None) -> dict:
    """Host wrapper of `simulate_iteration`: validates, runs, returns numpy values.

    `max_replicas` defaults to `params.num_replicas`; `requests` as in `simulate_iteration`.
    Raises ValueError naming the field.
    """
    if max_replicas is None:
        max_replicas = int(np.max(np.asarray(params.num_replicas)))
    validate_params(params, num_requests, max_replicas)
    floats, ints, bools = _fields(params.gpu)
    for f in floats + ints + bools:
        if np.ndim(getattr(params.gpu, f)) != 0:
            raise ValueError(f"params.gpu.{f} must be a scalar (identical replicas)")
    if np.ndim(params.num_replicas) != 0:
        raise ValueError("params.num_replicas must be a scalar here (vmap simulate_iteration "
                         "to batch it)")
    if requests is not None:
        requests = tuple(np.asarray(x, np.float64) for x in requests)
        if len(requests) != 3:
            raise ValueError("requests must be (prompt, output, estimate)")
        for name, x in zip(("prompt", "output", "estimate"), requests):
            if x.shape != (int(num_requests),) or not np.all(np.isfinite(x)) or np.any(x < 1):
                raise ValueError(f"requests {name} must be {int(num_requests)} finite token "
                                 f"counts >= 1")
    bound = (int(np.asarray(params.gpu.max_seqs)) if is_continuous(params) else None)
    out = simulate_iteration(key, params, rule_index(rule, params),
                             num_requests=int(num_requests), max_replicas=int(max_replicas),
                             max_batch_bound=bound, per_request=per_request, requests=requests)
    return jax.tree.map(np.asarray, out)


# ----------------------------------------------------------------------------- sweeps

_SWEPT = ("makespan_s", "mean_latency_s", "p50_latency_s", "p99_latency_s", "max_latency_s",
          "batches", "busy_s", "dropped")


@partial(jax.jit, static_argnames=("num_requests", "max_replicas", "max_batch_bound"))
def _sweep_program(keys, params, rules, max_batches, *, num_requests, max_replicas,
                   max_batch_bound):
    def point(mb, rule, r, key):
        p = params.replace(gpu=params.gpu.replace(**{_batch_field(params): mb}),
                           num_replicas=r)
        out = _simulate(key, p, rule, num_requests, max_replicas, max_batch_bound, False)
        return {k: out[k] for k in _SWEPT}

    f = jax.vmap(point, (None, None, None, 0))  # seeds
    f = jax.vmap(f, (None, None, 0, None))  # replica counts
    f = jax.vmap(f, (None, 0, None, None))  # rules
    f = jax.vmap(f, (0, None, None, None))  # max_batch values
    reps = jnp.arange(1, max_replicas + 1, dtype=jnp.int32)
    return f(max_batches, rules, reps, keys)


def sweep_raw(key: jax.Array, params: RolloutParams, *, num_requests: int, max_replicas: int,
              rules: Sequence[str | int] | None = None,
              max_batches: Sequence[int] | None = None, iterations: int = 8) -> dict:
    """Simulates every (max_batch, rule, r = 1..max_replicas, seed) point in ONE jitted program.

    The `iterations` seeds are `jax.random.split(key, iterations)`, shared by every point, so
    all comparisons are paired over the same request draws.

    Returns:
      dict: numpy arrays shaped `(len(max_batches), len(rules), max_replicas, iterations)` for
      `makespan_s, mean_latency_s, p50_latency_s, p99_latency_s, max_latency_s, batches,
      busy_s, dropped`; and `rules` (names), `max_batches`, `replicas` (1..R), `iterations`,
      `seconds` (compile + run wall time).
    """
    if rules is None:
        rules = list(CONTINUOUS_RULES if is_continuous(params) else RULES)
    rules = list(rules)
    if not rules:
        raise ValueError("rules must name at least one routing rule")
    idx = [rule_index(r, params) for r in rules]
    if max_batches is None:
        max_batches = [int(np.asarray(getattr(params.gpu, _batch_field(params))))]
    max_batches = [_check_int(b, "max_batches entry", 1) for b in max_batches]
    if not max_batches:
        raise ValueError("max_batches must hold at least one value")
    iterations = _check_int(iterations, "iterations", 1)
    max_replicas = _check_int(max_replicas, "max_replicas", 1)
    params = params.replace(num_replicas=jnp.int32(1))  # swept: 1..max_replicas
    validate_params(params, num_requests, max_replicas)
    for b in max_batches:
        _validate_gpu(params.gpu.replace(**{_batch_field(params): b}), where="params.gpu")
    bound = min(int(num_requests), max(max_batches))
    t0 = time.perf_counter()
    out = _sweep_program(jax.random.split(key, iterations), params,
                         jnp.asarray(idx, jnp.int32), jnp.asarray(max_batches, jnp.int32),
                         num_requests=int(num_requests), max_replicas=max_replicas,
                         max_batch_bound=bound)
    out = jax.tree.map(np.asarray, jax.block_until_ready(out))
    out.update(rules=[RULES[i] for i in idx], max_batches=max_batches,
               replicas=list(range(1, max_replicas + 1)), iterations=iterations,
               seconds=time.perf_counter() - t0)
    return out


def _ci95(x: np.ndarray, axis=-1) -> np.ndarray:
    return t_halfwidth(x, axis=axis)


def tabulate(raw: dict, *, train_s: float | Sequence[float] = 0.0, gpus_per_replica: float = 1.0,
             trainer_gpus: float = 0.0, reference: tuple[str, int] | None = None) -> list[dict]:
    """Tidy rows (one per train_s x max_batch x rule x r) from `sweep_raw`'s arrays.

    Training does not interact with serving, so `iteration_s = makespan_s + train_s` is exact
    for any `train_s` given here (float64 on the host). Per row (means over the seeds):

    - `iteration_s` (and `iteration_ci95`), `makespan_s`, latencies (s), `batches`,
      `utilisation` (busy replica-seconds / (r * iteration_s)).
    - `speedup`: mean T(1) / mean T(r) for the same max_batch and rule (paired draws); the
      wall-clock speedup of a run of many iterations. `speedup_ci95`: 95% half-width of the
      per-seed ratios T_s(1)/T_s(r).
    - `speedup_vs_ref`: mean T_ref(1) / mean T(r), against r = 1 of the `reference`
      (rule, max_batch) (default: round_robin if swept, else the first rule; the first
      max_batch), so that settings compare on one scale (sorting changes T(1) itself).
    - `efficiency`: speedup / r.
    - `gpu_hours`: r * gpus_per_replica * mean T(r) / 3600 per iteration; `trainer_gpu_hours`:
      trainer_gpus * mean T(r) / 3600; `total_gpu_hours` their sum.
    - `marginal_speedup_per_gpu_hour`: (speedup(r) - speedup(r-1)) / (gpu_hours(r) -
      gpu_hours(r-1)), NaN at r = 1 and +inf when the extra replica costs no GPU-hours.
    """
    rules, mbs, reps = raw["rules"], raw["max_batches"], raw["replicas"]
    ts_values = [float(train_s)] if np.ndim(train_s) == 0 else [float(t) for t in train_s]
    for t in ts_values:
        if not np.isfinite(t) or t < 0:
            raise ValueError(f"train_s must be finite and >= 0, got {t}")
    if reference is None:
        reference = ("round_robin" if "round_robin" in rules else rules[0], mbs[0])
    if reference[0] not in rules or reference[1] not in mbs:
        raise ValueError(f"reference {reference} is not among the swept rules/max_batches")
    ri, bi = rules.index(reference[0]), mbs.index(reference[1])
    mk = raw["makespan_s"].astype(np.float64)
    rows = []
    for ts in ts_values:
        it = mk + ts  # (B, rules, R, S)
        mean_t = it.mean(-1)
        ref_t1 = mean_t[bi, ri, 0]
        for b, mb in enumerate(mbs):
            for q, rule in enumerate(rules):
                prev = None
                for k, r in enumerate(reps):
                    t = mean_t[b, q, k]
                    ratio = it[b, q, 0] / np.maximum(it[b, q, k], 1e-300)
                    s = mean_t[b, q, 0] / t if t > 0 else 1.0
                    hours = r * gpus_per_replica * t / 3600.0
                    if prev is None:
                        marginal = np.nan
                    else:
                        dh, ds = hours - prev[1], s - prev[0]
                        marginal = ds / dh if dh > 0 else (np.inf if ds > 0 else np.nan)
                    busy = raw["busy_s"][b, q, k].astype(np.float64)
                    row = {
                        "train_s": ts, "max_batch": mb, "rule": rule, "replicas": r,
                        "iteration_s": t, "iteration_ci95": float(_ci95(it[b, q, k])),
                        "makespan_s": float(mk[b, q, k].mean()),
                        "speedup": float(s), "speedup_ci95": float(_ci95(ratio)),
                        "speedup_vs_ref": float(ref_t1 / t) if t > 0 else 1.0,
                        "efficiency": float(s / r),
                        "gpu_hours": float(hours),
                        "trainer_gpu_hours": float(trainer_gpus * t / 3600.0),
                        "total_gpu_hours": float(hours + trainer_gpus * t / 3600.0),
                        "marginal_speedup_per_gpu_hour": float(marginal),
                        "utilisation": float((busy / np.maximum(r * it[b, q, k], 1e-300)).mean()),
                    }
                    for f in ("mean_latency_s", "p50_latency_s", "p99_latency_s",
                              "max_latency_s", "batches"):
                        row[f] = float(raw[f][b, q, k].astype(np.float64).mean())
                    row["dropped"] = int(raw["dropped"][b, q, k].sum())
                    rows.append(row)
                    prev = (s, hours)
    return rows


def sweep(key: jax.Array, params: RolloutParams, *, num_requests: int, max_replicas: int,
          rules: Sequence[str | int] | None = None, max_batches: Sequence[int] | None = None,
          iterations: int = 8, train_s: float | Sequence[float] | None = None) -> list[dict]:
    """Replica counts 1..max_replicas x rules x max_batch values x seeds in one jitted program,
    as a tidy table (list of dicts, see `tabulate`).

    `train_s` defaults to `params.train_s`; `gpus_per_replica` and `trainer_gpus` come from
    `params`. Raises ValueError naming the field for bad configuration.
    """
    raw = sweep_raw(key, params, num_requests=num_requests, max_replicas=max_replicas,
                    rules=rules, max_batches=max_batches, iterations=iterations)
    if train_s is None:
        train_s = float(np.asarray(params.train_s))
    return tabulate(raw, train_s=train_s,
                    gpus_per_replica=float(np.asarray(params.gpus_per_replica)),
                    trainer_gpus=float(np.asarray(params.trainer_gpus)))


def pareto_front(speedup: Sequence[float], gpu_hours: Sequence[float]) -> np.ndarray:
    """Indices of the non-dominated points of (speedup: higher is better, gpu_hours: lower).

    A point is dominated when another has speedup >= and gpu_hours <=, one of them strictly.
    Returned in increasing gpu_hours order. Equal points are all kept.
    """
    s = np.asarray(speedup, np.float64)
    h = np.asarray(gpu_hours, np.float64)
    if s.shape != h.shape or s.ndim != 1:
        raise ValueError("speedup and gpu_hours must be 1-D arrays of equal length")
    keep = []
    for i in range(s.shape[0]):
        dom = (s >= s[i]) & (h <= h[i]) & ((s > s[i]) | (h < h[i]))
        if not dom.any():
            keep.append(i)
    keep = np.asarray(keep, np.int64)
    return keep[np.lexsort((-s[keep], h[keep]))] if keep.size else keep
