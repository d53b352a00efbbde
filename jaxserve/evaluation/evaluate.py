"""The evaluation harness: policies on common random numbers, exact per-request statistics.

Methodology (docs/baselines.md has the long form):

* Requests. Each of `num_envs` environments draws its own stream of `num_steps` requests
  (arrival gaps from `params.arrivals`, token lengths from `params.tokens`, with the engine's
  own samplers) from its key, or replays a given trace. The stream is fixed *before* any
  policy acts and is fed to the environment in trace mode, so every policy evaluated with the
  same key sees exactly the same arrivals and sizes (common random numbers). Routing-v0
  would give this from the step keys alone (its step draws the next arrival with a number of
  random draws that does not depend on the action), but Batching-v0 draws a fresh key per
  *event* (arrival or completion) between decisions, and how many events a step spans depends
  on the action, so its synthetic streams diverge across policies; the pre-drawn stream makes
  both environments CRN-exact.
* Horizon. Routing-v0 takes one decision per request; Batching-v0 at most two per request
  (a wait consumes an arrival, a dispatch at least one waiting request). The run ends when
  the last request has arrived and the cluster has drained, so every request that was not
  dropped has a finished, exact latency: nothing is censored, nothing is left in flight
  (`in_flight` reports it should a Batching-v0 run hit its `2 * num_steps + 2` decision cap).
* Latency of a request = wait + service from the environment's per-request log (the
  environment is rebuilt with `log_capacity = num_steps`); percentiles are exact
  (`numpy.percentile`, linear interpolation) over all measured requests of all environments
  pooled. Dropped requests have no latency; they are counted in `dropped`. The first `warmup`
  requests of each environment are simulated but excluded from latency statistics and rates.
* Rates: over each environment's window from the first measured arrival to the last finish
  (the makespan, drain included), summed over environments.
* Drops. `mean_latency` and the percentiles are over *served* requests only: a policy that
  drops requests is not charged for them there. `mean_latency_incl_drops` is the
  drop-inclusive mean: every measured request counts, a dropped one at `params.drop_penalty_s`
  seconds (600 s in the registered Routing-v0 and Batching-v0, 15x the Routing-v0 SLO: more
  than any served request's latency in the default scenarios), so dropping is never a way to
  look fast. Compare policies on it whenever either drops.
* Confidence intervals: each environment is one independent replicate; a 95% CI is the
  Student-t interval of the replicates' values (for the mean latency, of the per-environment
  mean latencies). Policies compared on one key see the same streams, so compare them with
  `core.stats.paired_difference` (the Student-t CI of the per-environment differences),
  not by whether their separate CIs overlap.
* Tuning and evaluation never share streams: policies that are fitted or tuned by simulation
  (`tuned_static`, `sita`, `scheduled`) use `core.sources.tuning_key(key)` (a `fold_in` with
  `TUNING_SALT`), every key used for tuning is recorded, and `evaluate_many` refuses a
  recorded one (`check_not_tuning_key`). A trace is split with `core.sources.split_trace`
  into a fitting window and a disjoint scored window.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core import arrivals as A
from jaxserve.core import cluster as C
from jaxserve.core.metrics import StepMetrics
from jaxserve.core.sources import (TraceArrays, check_not_tuning_key, params_trace,
                                   sample_stream_with_phase, trace_arrays)
from jaxserve.core.types import Trace, validate_trace
from jaxserve.envs import common
from jaxserve.envs.base import with_static
from jaxserve.evaluation import episodes
from jaxserve.evaluation.episodes import as_action
from jaxserve.core.stats import paired_difference, percentiles, t_halfwidth

# ----------------------------------------------------------------------------- building blocks

def is_routing(env) -> bool:
    """True for Routing-v0-style environments, False for Batching-v0; ValueError otherwise."""
    kind = getattr(env, "policy_kind", None)
    if kind not in ("routing", "batching"):
        raise ValueError(f"evaluate needs a jaxserve Routing or Batching environment, got "
                         f"{type(env).__name__}")
    return kind == "routing"


def trace_env(env, n: int):
    """`env` rebuilt for replaying `n`-request streams with a per-request log (cached)."""
    return with_static(env, trace_len=int(n), log_capacity=int(n))


def host_trace(trace: Trace) -> TraceArrays:
    """A validated host trace as `TraceArrays` (no padding)."""
    return trace_arrays(validate_trace(trace))


def rollout(env_t, policy: Callable, params: common.ServingParams, key, routing: bool) -> dict:
    """Runs one environment (trace mode, `params.trace` = the stream) to the end of the stream.

    Not jitted; callers vmap and jit it. `policy` may close over traced values.

    Returns:
      dict: `wait`, `service`, `batch` `(n,)` from the request log; `gpu` `(n,)` int32 (the
      GPU each request was routed to; 0 in Batching-v0); `sums` (StepMetrics summed over the
      steps; Batching-v0's first step reports the requests its reset admitted, so
      `sums.arrived` counts every arrival); `in_flight` (waiting plus running at the end);
      `decisions`.
    """
    n = params.trace.gap.shape[0]
    k_reset, k_step, k_pol = jax.random.split(key, 3)
    obs, state = env_t.reset_env(k_reset, params)
    act = episodes.from_policy(policy, params)

    if routing:
        # One decision per request: step i with fold_in(k_step, i), the policy with
        # fold_in(k_pol, i).
        idx = jnp.arange(n, dtype=jnp.int32)
        pol_keys = jax.vmap(lambda i: jax.random.fold_in(k_pol, i))(idx)
        env_keys = jax.vmap(lambda i: jax.random.fold_in(k_step, i))(idx)

        def fold(sums, s: episodes.Step):
            return sums + StepMetrics(**s.info), jnp.clip(s.action, 0, env_t.num_gpus - 1)

        obs, state, _, sums, gpu = episodes.scan_steps(
            env_t, act, params, obs, state, pol_keys, env_keys, fold=fold,
            acc=StepMetrics.zeros())
        decisions = jnp.int32(n)
    else:
        # Batching-v0 takes a data-dependent number of decisions (at most 2 per request): a
        # while_loop to the episode's end, so a lane stops as soon as it has drained.
        def keys_of(i):
            return jax.random.fold_in(k_pol, i), jax.random.fold_in(k_step, i)

        def fold(sums, s: episodes.Step):
            return sums + StepMetrics(**s.info)

        obs, state, _, sums, decisions = episodes.loop_steps(
            env_t, act, params, obs, state, keys_of, 2 * n + 2, fold=fold,
            acc=StepMetrics.zeros())
        gpu = jnp.zeros((n,), jnp.int32)
    return {"wait": state.log.wait, "service": state.log.service, "batch": state.log.batch,
            "gpu": gpu, "sums": sums,
            "in_flight": C.in_system(state.cluster), "decisions": decisions}


def asked_along_rollout(env_t, policy: Callable, params: common.ServingParams, key,
                        ask: Callable):
    """`ask(key, obs, state, action)` at every decision of `policy`'s routing rollout.

    The trajectory is the one `rollout` runs for `evaluate` (the same reset, environment and
    policy keys, one decision per request of `params.trace`); `ask` sees each decision's
    policy key, observation, state and the action taken, before the step, and acts on
    nothing. Not jitted. Returns `ask`'s outputs stacked over the decisions."""
    n = params.trace.gap.shape[0]
    k_reset, k_step, k_pol = jax.random.split(key, 3)
    obs, state = env_t.reset_env(k_reset, params)

    def body(carry, i):
        obs, state = carry
        kp, ke = jax.random.fold_in(k_pol, i), jax.random.fold_in(k_step, i)
        a = as_action(policy(kp, obs, state, params))
        y = ask(kp, obs, state, a)
        obs, state, _, _, _ = env_t.step_env(ke, state, a, params)
        return (obs, state), y

    _, ys = jax.lax.scan(body, (obs, state), jnp.arange(n, dtype=jnp.int32))
    return ys


def rollout_envs(env_t, policy, params, streams: TraceArrays, keys, routing: bool):
    """`rollout` vmapped over environments: `streams` and `keys` have a leading `(E,)` axis."""
    def one(stream, key):
        return rollout(env_t, policy, params.replace(trace=stream), key, routing)
    return jax.vmap(one)(streams, keys)


def switch_policy(policies, index):
    """The policy `policies[index]` with a traced `index` (one program for all policies)."""
    branches = [lambda k, o, s, p, f=f: as_action(f(k, o, s, p)) for f in policies]
    if len(branches) == 1:
        return branches[0]
    return lambda k, o, s, p: jax.lax.switch(index, branches, k, o, s, p)


@partial(jax.jit, static_argnames=("env_t", "policies", "routing"))
def _run_policies(env_t, policies, params, streams, keys, routing):
    """All `policies` x all environments, one compiled program: `(P, E, ...)` outputs."""
    def per_policy(i):
        return rollout_envs(env_t, switch_policy(policies, i), params, streams, keys, routing)
    return jax.vmap(per_policy)(jnp.arange(len(policies)))


def make_streams(key, params, num_envs: int, num_steps: int, trace: Trace | None):
    """Per-environment request streams `(E, n)` and rollout keys `(E,)`.

    A given trace (or one held in `params`) is shared by all environments; otherwise each
    environment draws its own `num_steps` requests.
    """
    streams, keys, _ = make_streams_with_phase(key, params, num_envs, num_steps, trace)
    return streams, keys


def make_streams_with_phase(key, params, num_envs: int, num_steps: int, trace: Trace | None):
    """`make_streams`' streams and keys, and each request's arrival phase `(E, n)` int32 (the
    phase of the arrival process it arrived in; 0 for a Poisson process or a trace)."""
    k_stream, k_roll = jax.random.split(key)
    keys = jax.random.split(k_roll, num_envs)
    trace = params_trace(params) if trace is None else trace
    if trace is not None:
        arr = host_trace(trace)
        streams = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_envs,) + x.shape), arr)
        return streams, keys, jnp.zeros(streams.gap.shape, jnp.int32)
    streams, phases = _sample_streams(jax.random.split(k_stream, num_envs), params,
                                      int(num_steps))
    return streams, keys, phases


@partial(jax.jit, static_argnames=("n",))
def _sample_streams(keys, params, n: int) -> tuple[TraceArrays, jax.Array]:
    return jax.vmap(sample_stream_with_phase, in_axes=(0, None, None))(keys, params, n)


def _check_args(env, params, num_envs, num_steps, warmup):
    routing = is_routing(env)
    if int(num_envs) < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    if int(num_steps) < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if int(warmup) < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    common.validate_params(params, env.queue_buffer, getattr(env, "max_batch", None),
                           env.num_gpus)
    return routing


# ----------------------------------------------------------------------------- statistics

# CIs and paired differences live in `stats`; re-exported here for existing callers.
def paired_table(results: Mapping[str, dict], reference: str,
                 metrics=("mean_latency_incl_drops", "mean_latency", "goodput")) -> dict:
    """`{policy: {metric: paired_difference(policy, reference)}}` for every other policy.

    `results` come from one `evaluate_many` call (same streams); `metric` names a per-env
    replicate (`mean_latency_incl_drops` reads `per_env["latency_incl_drops"]`).
    """
    if reference not in results:
        raise ValueError(f"reference policy {reference!r} is not among {sorted(results)}")
    per = {"mean_latency_incl_drops": "latency_incl_drops"}
    ref = results[reference]["per_env"]
    return {name: {m: paired_difference(r["per_env"][per.get(m, m)], ref[per.get(m, m)])
                   for m in metrics}
            for name, r in results.items() if name != reference}


def summarise(out: dict, streams: TraceArrays, params, warmup: int = 0,
              phases=None) -> dict:
    """Host-side metrics of one policy's `(E, ...)` rollout outputs (see `evaluate`);
    `phases`: each request's arrival phase `(E, n)` (default: all 0)."""
    wait = np.asarray(out["wait"], np.float64)
    service = np.asarray(out["service"], np.float64)
    num_envs, n = wait.shape
    gap = np.asarray(streams.gap, np.float64).reshape(num_envs, n)
    arrival = np.cumsum(gap, axis=1)
    lat = wait + service
    done = np.isfinite(lat)
    measured = np.arange(n)[None, :] >= warmup
    ok = done & measured
    if warmup >= n:
        raise ValueError(f"warmup ({warmup}) must be smaller than the number of requests ({n})")
    slo = float(np.asarray(params.slo_s))
    finish = np.where(done, arrival + lat, -np.inf)
    t0 = arrival[:, warmup]
    t1 = np.maximum(arrival[:, -1], finish.max(axis=1))
    window = np.maximum(t1 - t0, 1e-12)

    pooled = lat[ok]
    pct = percentiles(pooled, [50, 90, 99])
    per_env_n = ok.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_env_mean = np.where(per_env_n > 0, np.where(ok, lat, 0.0).sum(1) / per_env_n, np.nan)
        per_env_p99 = np.array([percentiles(lat[e][ok[e]], [99])[0] for e in range(num_envs)])
    penalty = float(np.asarray(params.drop_penalty_s))
    # Drop-inclusive: served requests at their latency, dropped ones at the drop penalty.
    dropped_req = ~done & measured
    per_env_m = measured.sum(axis=1) * np.ones(num_envs)
    per_env_incl = ((np.where(ok, lat, 0.0).sum(1) + penalty * dropped_req.sum(1))
                    / np.maximum(per_env_m, 1))
    per_env_good = (ok & (lat <= slo)).sum(axis=1)
    per_env_tput = per_env_n / window
    per_env_goodput = per_env_good / window

    # Per-GPU busy time inside each window, from the batches in the log.
    gpu = np.asarray(out["gpu"]).reshape(num_envs, n)
    batch = np.asarray(out["batch"]).reshape(num_envs, n)
    num_gpus = int(np.asarray(params.gpus.c0).shape[0])
    busy = np.zeros(num_gpus)
    busy_all = np.zeros(num_gpus)
    if done.any():
        e_idx = np.broadcast_to(np.arange(num_envs)[:, None], (num_envs, n))[done]
        bkey = (e_idx * num_gpus + gpu[done]) * (n + 1) + batch[done]
        _, first = np.unique(bkey, return_index=True)
        start = (arrival + wait)[done][first]
        svc = service[done][first]
        env_of = e_idx[first]
        g_of = gpu[done][first]
        clip = np.clip(np.minimum(start + svc, t1[env_of]) - np.maximum(start, t0[env_of]),
                       0.0, None)
        np.add.at(busy, g_of, clip)
        np.add.at(busy_all, g_of, svc)

    sizes = np.asarray(A.size_class(jnp.asarray(streams.output).reshape(num_envs, n),
                                    params.size_edges))
    num_classes = int(np.asarray(params.size_values).shape[-1])
    phase = (np.zeros((num_envs, n), np.int64) if phases is None
             else np.asarray(phases, np.int64).reshape(num_envs, n))
    arrivals = getattr(params, "arrivals", None)
    num_phases = max(int(phase.max()) + 1, arrivals.num_phases if arrivals is not None else 1)
    mix_by_phase = np.zeros((num_phases, num_gpus, num_classes), np.int64)
    rows = np.broadcast_to(measured, (num_envs, n))
    np.add.at(mix_by_phase, (phase[rows], gpu[rows], sizes[rows]), 1)
    mix = mix_by_phase.sum(axis=0)

    sums = {k: np.asarray(v, np.float64) for k, v in out["sums"].as_dict().items()}
    arrived_env = sums["arrived"]
    arrived = int(arrived_env.sum())
    per_env_cost = ((sums["in_system_time"] + penalty * sums["dropped"])
                    / np.maximum(arrived_env, 1.0))
    dropped_measured = int((~done & measured).sum())
    total_window = float(window.sum())
    res = {
        "num_envs": num_envs,
        "requests_per_env": n,
        "warmup": int(warmup),
        "measured": int(measured.sum() * num_envs),
        "mean_latency": float(pooled.mean()) if pooled.size else float("nan"),
        "mean_latency_ci95": t_halfwidth(per_env_mean),
        "mean_latency_incl_drops": float(per_env_incl.mean()),
        "mean_latency_incl_drops_ci95": t_halfwidth(per_env_incl),
        "drop_penalty_s": penalty,
        "p50_latency": float(pct[0]),
        "p90_latency": float(pct[1]),
        "p99_latency": float(pct[2]),
        "p99_latency_ci95": t_halfwidth(per_env_p99),
        "max_latency": float(pooled.max()) if pooled.size else float("nan"),
        "throughput": float(per_env_n.sum() / total_window),
        "throughput_ci95": t_halfwidth(per_env_tput),
        "goodput": float(per_env_good.sum() / total_window),
        "goodput_ci95": t_halfwidth(per_env_goodput),
        "cost_per_request": float(per_env_cost.mean()),
        "cost_ci95": t_halfwidth(per_env_cost),
        "slo_s": slo,
        "slo_attainment": float(per_env_good.sum() / max(measured.sum() * num_envs, 1)),
        "dropped": dropped_measured,
        "drop_rate": float(dropped_measured / max(measured.sum() * num_envs, 1)),
        "utilisation": busy / total_window,
        "gpu_seconds": float(busy.sum()),
        "sim_seconds": total_window,
        "class_mix": mix,
        "class_mix_by_phase": mix_by_phase,
        "arrived": arrived,
        "completed": int(sums["completed"].sum()),
        "dropped_total": int(sums["dropped"].sum()),
        "in_flight": int(np.asarray(out["in_flight"]).sum()),
        "busy_time_total": float(sums["busy_time"].sum()),
        "busy_time_log": float(busy_all.sum()),
        "invalid_actions": int(sums["invalid_actions"].sum()),
        "decisions": int(np.asarray(out["decisions"]).sum()),
        "latencies": pooled,
        "per_env": {"mean_latency": per_env_mean, "latency_incl_drops": per_env_incl,
                    "p99_latency": per_env_p99,
                    "throughput": per_env_tput, "goodput": per_env_goodput,
                    "cost_per_request": per_env_cost},
    }
    return res


# ----------------------------------------------------------------------------- public API

def evaluate_many(env, params, policies: Mapping[str, Callable], key, num_envs: int = 16,
                  num_steps: int = 1000, *, warmup: int = 0, trace: Trace | None = None
                  ) -> dict[str, dict]:
    """Evaluates several policies on common random numbers (one compiled program).

    Every policy gets the same keys, hence the same request streams (see the module
    docstring: the streams are drawn before any policy acts), the same environment keys and
    the same policy keys.

    Args:
      env (Environment): a Routing-v0 or Batching-v0 environment.
      params (ServingParams): its parameters.
      policies: `{name: policy}`, each `policy(key, obs, state, params) -> int32 action`.
      key (jax.Array): PRNG key.
      num_envs: independent environments (replicates for the CIs).
      num_steps: requests per environment (Routing-v0: decisions; ignored with a trace).
      warmup: first requests of each environment excluded from the statistics.
      trace: a `Trace` replayed by every environment instead of synthetic arrivals (with a
        trace the replicates differ only in policy and estimate randomness).

    Returns:
      `{name: metrics}`, metrics as documented in `evaluate`.
    """
    routing = _check_args(env, params, num_envs, num_steps, warmup)
    check_not_tuning_key(key)
    if not policies:
        raise ValueError("evaluate_many needs at least one policy")
    for name, pol in policies.items():
        if not callable(pol):
            raise ValueError(f"policy {name!r} is not callable")
    streams, keys, phases = make_streams_with_phase(key, params, int(num_envs), int(num_steps),
                                                    trace)
    n = streams.gap.shape[1]
    if int(warmup) >= n:
        raise ValueError(f"warmup ({warmup}) must be smaller than the number of requests ({n})")
    env_t = trace_env(env, n)
    out = _run_policies(env_t, tuple(policies.values()), params, streams, keys, routing)
    out = jax.device_get(out)
    return {name: summarise(jax.tree.map(lambda x, i=i: x[i], out), streams, params, warmup,
                            phases)
            for i, name in enumerate(policies)}


def evaluate(env, params, policy: Callable, key, num_envs: int = 16, num_steps: int = 1000,
             *, warmup: int = 0, trace: Trace | None = None) -> dict:
    """Evaluates one policy: exact latency percentiles, rates, utilisation, 95% CIs.

    Args: as `evaluate_many`, with one `policy(key, obs, state, params) -> action`.

    Returns:
      dict (floats unless noted; seconds, requests/s):
        mean_latency, p50_latency, p90_latency, p99_latency, max_latency: over all measured
          requests that were served (pooled across environments; exact percentiles). They
          EXCLUDE dropped requests.
        mean_latency_incl_drops, mean_latency_incl_drops_ci95: drop-inclusive mean latency,
          every measured request counted, a dropped one at `drop_penalty_s` seconds (the
          mean of the per-environment values); drop_penalty_s: the penalty used.
        mean_latency_ci95, p99_latency_ci95, throughput_ci95, goodput_ci95: 95% CI
          half-widths over environments.
        throughput: served requests per second; goodput: served within `params.slo_s` per
          second; slo_attainment: that fraction of measured requests.
        dropped (int), drop_rate: measured requests refused by a full queue.
        utilisation: `(num_gpus,)` busy fraction of each GPU; gpu_seconds: busy GPU-seconds;
          sim_seconds: simulated seconds (summed over environments).
        class_mix: `(num_gpus, num_classes)` int, measured requests per GPU and size class (by
          the true output length: a report, not something a policy saw).
        class_mix_by_phase: `(phases, num_gpus, num_classes)` int, `class_mix` split by the
          arrival phase each request arrived in (one row per phase of `params.arrivals`, all
          requests in row 0 for a replayed trace; for a bursty MMPP, phase 1 is the burst).
        arrived, completed, dropped_total, in_flight (ints): accounting over everything
          simulated; `arrived == completed + dropped_total + in_flight`.
        busy_time_total (engine's counter) and busy_time_log (from the log): equal.
        cost_per_request, cost_ci95: the environments' own objective per request,
          `(time-in-system + drop_penalty_s * drops) / arrived` (s), over everything simulated
          (warmup included): the mean latency when nothing is dropped.
        invalid_actions, decisions (ints); latencies: the pooled latencies (numpy);
        per_env: per-environment replicates of mean latency, drop-inclusive mean latency
          (`latency_incl_drops`), p99 latency, throughput, goodput, cost; pair them across
          policies with `paired_difference`.
    """
    return evaluate_many(env, params, {"policy": policy}, key, num_envs, num_steps,
                         warmup=warmup, trace=trace)["policy"]
