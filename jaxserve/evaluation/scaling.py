"""Evaluation of autoscalers on Autoscaling-v0: cost and latency on common random numbers.

Every policy runs `num_envs` episodes of `num_steps` control intervals with the same keys.
Autoscaling-v0 draws each interval's arrivals from that interval's step key alone, and how many
requests arrive does not depend on the replicas, so all policies see exactly the same requests
(common random numbers); a replayed trace is the same for all by construction. With a trace
the run stops at the episode's natural end (trace over, cluster drained); intervals after it
are masked out.

Reported per policy (mean over episodes, with the 95% Student-t half-width `*_ci95` over the
episodes): `gpu_hours` per episode, `mean_replicas` provisioned, `mean_latency` (s, over the
completed requests), `slo_violation_rate` and `drop_rate` (per arrived request), `in_flight`
(requests still in the system at the end: their latency is in `cost` but not `mean_latency`),
`latency_cost` (request-seconds in system), `cost` (the environment's own cost: latency,
SLO and drop penalties and `gpu_price` x GPU-seconds, in request-seconds) and `return`.

Tail latency, exact: the evaluation runs a variant of the environment that keeps a
per-request log (`with_static(env, log_capacity=n)`; training environments keep none and pay
nothing), so each request's latency (start - arrival + its batch's service time, known at
dispatch) is exact. Per episode, `p99_latency` is the 99th percentile (linear interpolation,
`stats.percentiles`) over the requests dispatched by the episode's end, and
`p99_latency_drops` the same with every dropped request counted as infinitely late
(`stats.percentile_with_drops`): a policy cannot lower its tail by shedding load (it is
`inf` once more than ~1% are dropped). Requests still waiting at the end (`in_flight`
counts them with the running ones) are in neither.

Comparisons (host side): `verdicts` places each adaptive policy against the fixed-count
frontier (`frontier_latency`), HPA, Knative and Ray Serve (cost, and p99 when measured);
`paired_comparisons` gives paired per-episode differences of `PAIRED_METRICS` against them
and every fixed count. Tuning on keys disjoint from the reported ones
(`core.sources.tuning_key`): `tune_scheduled` (the `scheduled` reference's one setting) and
`tune_told_price` (the price a price-conditioned learned policy is told: the cheapest whose
p99 is no worse than every reactive autoscaler's).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import policies as P
from jaxserve.core.sources import tuning_key
from jaxserve.core.stats import paired_difference, percentile_with_drops, percentiles, t_halfwidth
from jaxserve.envs.autoscaling import LOG_DROPPED, Autoscaling, AutoscalingParams
from jaxserve.envs.base import with_static
from jaxserve.evaluation.episodes import Step, from_policy, run_episode
from jaxserve.evaluation.evaluate import switch_policy

# The reactive autoscalers a learned one must beat (`verdicts`, `paired_comparisons`).
AUTOSCALERS = ("hpa", "knative", "ray_serve")

SUMS = ("arrived", "completed", "dropped", "latency_sum", "slo_violations", "gpu_seconds",
        "in_system_time", "cost", "reward", "intervals")


def episode_totals(env: Autoscaling, policy: Callable, params: AutoscalingParams, key,
                   num_steps: int) -> dict[str, jax.Array]:
    """Runs one episode of `num_steps` intervals under `policy`; sums its per-interval info.

    The episode is not truncated inside the run (`max_steps_in_episode` is raised to cover it)
    and intervals after a natural termination are masked. Returns float32 totals (`SUMS`)
    plus `in_flight`, the requests left in the system at the end, and, when `env` keeps a
    request log, `latency`: `(log_capacity,)` per-request latency (s) by arrival order, `inf`
    for a dropped request, NaN for one not dispatched by the end (or never arrived).
    """
    sp = params.serving
    params = params.replace(serving=sp.replace(
        max_steps_in_episode=jnp.maximum(sp.max_steps_in_episode, num_steps + 1)))

    def fold(acc, s: Step):
        cost = -s.reward * sp.latency_scale
        row = {name: jnp.where(s.live, jnp.asarray(s.info[name], jnp.float32), 0.0)
               for name in SUMS[:-3]}
        row.update(cost=jnp.where(s.live, cost, 0.0), reward=jnp.where(s.live, s.reward, 0.0),
                   intervals=s.live.astype(jnp.float32))
        return acc, row

    _, state, _, _, rows = run_episode(env, from_policy(policy, params), params, key,
                                       num_steps, fold=fold)
    totals = {k: v.sum() for k, v in rows.items()}
    # Through the engine, so continuous-batching replicas (LLMAutoscaling-v0) count too.
    totals["in_flight"] = env.ENGINE.held(state.cluster).sum().astype(jnp.float32)
    if env.log_capacity > 0:
        lg = state.log
        totals["latency"] = jnp.where(lg.batch >= 0, lg.wait + lg.service,
                                      jnp.where(lg.batch == LOG_DROPPED, jnp.inf, jnp.nan))
    return totals


@partial(jax.jit, static_argnames=("env", "policies", "num_steps"))
def _run(env, policies, params, keys, num_steps, windows=None):
    def episode(pol, k, w):
        p = params if w is None else params.replace(serving=params.serving.replace(trace=w))
        return episode_totals(env, pol, p, k, num_steps)

    if env.log_capacity > 0:
        # With a request log, episodes run one after another (`lax.map`): under vmap, every
        # iteration of the batched event loops would select, hence copy, the whole
        # `(lanes, log_capacity)` log; unbatched, the log is updated in place.
        num_envs = keys.shape[0]

        def one(ij):
            j = ij % num_envs
            w = None if windows is None else jax.tree.map(lambda x: x[j], windows)
            return episode(switch_policy(policies, ij // num_envs), keys[j], w)
        out = jax.lax.map(one, jnp.arange(len(policies) * num_envs))
        return jax.tree.map(lambda x: x.reshape((len(policies), num_envs) + x.shape[1:]), out)

    def per_policy(i):
        pol = switch_policy(policies, i)
        return jax.vmap(lambda k, w: episode(pol, k, w))(keys, windows)
    return jax.vmap(per_policy)(jnp.arange(len(policies)))


def per_episode(totals: dict, control_interval_s: float) -> dict[str, np.ndarray]:
    """Host-side `(E,)` per-episode metrics from episode totals (see the module docstring);
    episode `i` of every policy ran on the same streams, so pair them
    (`core.stats.paired_difference`)."""
    t = {k: np.asarray(v, np.float64) for k, v in totals.items()}
    completed = np.maximum(t["completed"], 1.0)
    arrived = np.maximum(t["arrived"], 1.0)
    duration = np.maximum(t["intervals"] * control_interval_s, 1e-9)
    tail = {}
    if "latency" in t:
        tail = {"p99_latency": np.array([percentiles(row, [99.0])[0] for row in t["latency"]]),
                "p99_latency_drops": np.array([p99_with_drops(row) for row in t["latency"]])}
    return {**tail,
        "gpu_hours": t["gpu_seconds"] / 3600.0,
        "mean_replicas": t["gpu_seconds"] / duration,
        "mean_latency": np.where(t["completed"] > 0, t["latency_sum"] / completed, np.nan),
        "slo_violation_rate": t["slo_violations"] / arrived,
        "drop_rate": t["dropped"] / arrived,
        "in_flight": t["in_flight"],
        "latency_cost": t["in_system_time"],
        "cost": t["cost"],
        "return": t["reward"],
    }


def p99_with_drops(latency) -> float:
    """99th percentile of one episode's logged latencies (`episode_totals`), dropped requests
    (`inf`) counted as infinitely late, requests not dispatched by the end (NaN) left out."""
    lat = np.asarray(latency, np.float64)
    lat = lat[~np.isnan(lat)]
    return percentile_with_drops(np.where(np.isinf(lat), np.nan, lat), 99.0)


def summarise(totals: dict, control_interval_s: float) -> dict:
    """Host-side per-policy metrics from `(E,)` episode totals (see the module docstring)."""
    t = {k: np.asarray(v, np.float64) for k, v in totals.items()}
    per_env = per_episode(totals, control_interval_s)
    out: dict = {"num_envs": int(t["cost"].shape[0]),
                 "intervals": float(t["intervals"].mean()),
                 "arrived": float(t["arrived"].mean()), "dropped": int(t["dropped"].sum())}
    for k, v in per_env.items():
        if np.isposinf(v).any():  # p99 with drops past the 1% tail: the mean is inf
            out[k], out[k + "_ci95"] = float("inf"), float("nan")
            continue
        out[k] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
        out[k + "_ci95"] = t_halfwidth(v)
    return out


def evaluate_autoscalers(env: Autoscaling, params: AutoscalingParams,
                         policies: Mapping[str, Callable], key, num_envs: int = 8,
                         num_steps: int | None = None, episodes: bool = False,
                         log_capacity: int | None = None,
                         windows=None) -> dict[str, dict]:
    """Evaluates autoscaling policies on common random numbers (one compiled program).

    Args:
      env, params: an Autoscaling-v0 environment and its parameters.
      policies: `{name: policy}`, each `policy(key, obs, state, params) -> int32 action`.
      key: PRNG key; the same episodes for every policy.
      num_envs: independent episodes (replicates for the CIs).
      num_steps: control intervals per episode (default `max_steps_in_episode`; with a trace,
        default: enough to replay it and drain, its duration plus 10%, plus 40 intervals).
      episodes: also return the per-episode metrics, for paired comparisons.
      log_capacity: requests logged per episode for the exact p99 (None: a bound on the
        arrivals, `arrival_bound`; 0: no log and no p99).
      windows: disjoint windows of a replayed trace (`traces.windows`, `TraceArrays` with
        leaves `(W, L)`): episode `w` replays window `w` (replacing `params`' trace), so a
        deterministic replay still gives `W` replicates for the CIs; `num_envs` is then W.

    Returns:
      `{name: metrics}` (see the module docstring); with `episodes=True`, the pair
      `({name: metrics}, {name: per_episode metrics})`.

    Raises:
      ValueError: not an Autoscaling-v0 environment, no policies, bad sizes, or an episode
        with more arrivals than `log_capacity` (its p99 would not be exact).
    """
    if not isinstance(env, Autoscaling):
        raise ValueError(f"evaluate_autoscalers needs an Autoscaling-v0 environment, got "
                         f"{type(env).__name__}")
    if not policies:
        raise ValueError("policies must name at least one policy")
    if int(num_envs) < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    if windows is not None:
        # One environment of the windows' shape; each episode's trace is a traced leaf.
        env = with_static(env, trace_len=int(windows.gap.shape[1]))
        num_envs = int(windows.gap.shape[0])
        params = params.replace(serving=params.serving.replace(
            trace=jax.tree.map(lambda x: x[int(np.argmax(np.asarray(windows.length)))],
                               windows)))
    env.check_params(params)
    dt = float(params.control_interval_s)
    if num_steps is None:
        tr = params.serving.trace
        if int(tr.length) > 0:
            duration = float(np.asarray(tr.gap, np.float64)[: int(tr.length)].sum())
            num_steps = int(np.ceil(1.1 * duration / dt)) + 40
        else:
            num_steps = int(params.serving.max_steps_in_episode)
    if int(num_steps) < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    cap = arrival_bound(params, int(num_steps)) if log_capacity is None else int(log_capacity)
    if not isinstance(env.ENGINE, type(Autoscaling.ENGINE)):
        cap = 0  # continuous-batching replicas keep no request log
    names = list(policies)
    keys = jax.random.split(key, int(num_envs))
    totals = _run(with_static(env, log_capacity=cap), tuple(policies[n] for n in names), params,
                  keys, int(num_steps), windows)
    most = int(np.max(np.asarray(totals["arrived"])))
    if cap > 0 and most > cap:
        raise ValueError(f"an episode had {most} arrivals, more than log_capacity={cap}: pass a "
                         f"larger log_capacity for an exact p99")
    per = {n: {k: v[i] for k, v in totals.items()} for i, n in enumerate(names)}
    summaries = {n: summarise(t, dt) for n, t in per.items()}
    if episodes:
        return summaries, {n: per_episode(t, dt) for n, t in per.items()}
    return summaries


def arrival_bound(params: AutoscalingParams, num_steps: int) -> int:
    """Requests an episode of `num_steps` intervals will not exceed, in practice: a trace's
    rows, or the peak rate x duration plus 8 Poisson standard deviations and 64."""
    tr = params.serving.trace
    if tr.gap.shape[0] > 0:
        return int(tr.length) + 1
    peak = float(np.max(np.asarray(params.serving.arrivals.rates))) * (
        1.0 + float(params.diurnal_amplitude))
    mean = peak * num_steps * float(params.control_interval_s)
    return int(np.ceil(mean + 8.0 * np.sqrt(mean) + 64))


# ----------------------------------------------------------------------- comparisons

PAIRED_METRICS = ("cost", "mean_latency", "p99_latency", "slo_violation_rate", "gpu_hours")


def frontier_latency(points: dict[str, dict], gpu_hours: float) -> float:
    """Fixed-count frontier: their mean latency linearly interpolated at `gpu_hours` (NaN
    outside the fixed counts' GPU-hour range)."""
    xs = np.array([r["gpu_hours"] for r in points.values()])
    ys = np.array([r["mean_latency"] for r in points.values()])
    order = np.argsort(xs)
    xs, ys = xs[order], ys[order]
    if not xs[0] <= gpu_hours <= xs[-1]:
        return float("nan")
    return float(np.interp(gpu_hours, xs, ys))


def verdicts(results: dict[str, dict]) -> dict[str, dict]:
    """For each non-fixed policy: cheaper than every fixed count; below the fixed-count
    frontier; against each reactive autoscaler (`AUTOSCALERS`) present, `cheaper_than_X`
    and, with a measured p99, `p99_le_X` (p99 no worse); `beats_autoscalers`: cheaper than
    all of them at equal or better p99 (None without p99 or without them)."""
    fixed = {n: r for n, r in results.items() if n.startswith("fixed-")}
    out = {}
    for n, r in results.items():
        if n.startswith("fixed-"):
            continue
        front = frontier_latency(fixed, r["gpu_hours"])
        v = {"cheaper_than_every_fixed": bool(all(r["cost"] < f["cost"] for f in fixed.values())),
             "frontier_latency_s": front,
             "below_fixed_frontier": bool(np.isfinite(front) and r["mean_latency"] < front)}
        others = [o for o in AUTOSCALERS if o in results and o != n]
        for o in AUTOSCALERS:
            v[f"cheaper_than_{o}"] = bool(r["cost"] < results[o]["cost"]) if o in others else None
            v[f"p99_le_{o}"] = (bool(r["p99_latency"] <= results[o]["p99_latency"])
                                if o in others and "p99_latency" in r else None)
        checks = [v[f"{c}_{o}"] for o in others for c in ("cheaper_than", "p99_le")]
        v["beats_autoscalers"] = (bool(all(checks)) if others and "p99_latency" in r
                                  else None)
        out[n] = v
    return out


def paired_comparisons(per_env: dict, subjects: list[str]) -> dict:
    """Paired differences (subject - other, same episodes) of `PAIRED_METRICS` against HPA,
    Knative, Ray Serve and every fixed count: `{subject: {other: {metric: stats}}}`."""
    others = [n for n in per_env if n.startswith("fixed-") or n in AUTOSCALERS]
    return {s: {o: {m: paired_difference(per_env[s][m], per_env[o][m])
                    for m in PAIRED_METRICS if m in per_env[s]}
                for o in others} for s in subjects if s in per_env}


# --------------------------------------------------------------------------- tuning

def tune_scheduled(env: Autoscaling, params: AutoscalingParams, eval_key, grid,
                   num_envs: int = 8, num_steps: int | None = None) -> tuple[float, dict]:
    """`scheduled`'s `replicas_at_mean`: the cheapest of `grid` on episodes drawn from
    `tuning_key(eval_key)` (disjoint from the reported ones). Returns `(choice, {c: cost})`;
    one value is returned untuned."""

    grid = [float(c) for c in grid]
    if not grid:
        raise ValueError("the scheduled grid needs at least one value")
    if len(grid) == 1:
        return grid[0], {}
    pols = {str(c): P.get("scheduled", env=env, params=params, replicas_at_mean=c)
            for c in grid}
    res = evaluate_autoscalers(env, params, pols, tuning_key(eval_key), num_envs, num_steps,
                               log_capacity=0)
    costs = {c: res[str(c)]["cost"] for c in grid}
    return min(costs, key=costs.get), costs


def choose_told_price(results: dict[str, dict], candidates: Mapping[str, float]) -> tuple:
    """The told price whose policy is cheapest among those with p99 no worse than every
    reactive autoscaler's in `results`; with none, the one of lowest p99.

    `candidates`: `{result name: told price}`. Returns `(price, name, feasible)`."""
    bound = min(results[o]["p99_latency"] for o in AUTOSCALERS if o in results)
    ok = [n for n in candidates if results[n]["p99_latency"] <= bound]
    if ok:
        best = min(ok, key=lambda n: results[n]["cost"])
    else:
        best = min(candidates, key=lambda n: results[n]["p99_latency"])
    return candidates[best], best, bool(ok)


def tune_told_price(env: Autoscaling, params: AutoscalingParams, eval_key,
                    policies: Mapping[str, Callable], prices, num_envs: int = 8,
                    num_steps: int | None = None, windows=None) -> dict:
    """For each price-conditioned learned policy, the price to tell it (`choose_told_price`),
    on episodes from `tuning_key(eval_key)`, disjoint from the reported ones, or, for a
    replayed trace, on `windows` of a part of it disjoint from the evaluated one (e.g. the
    training part, `workload="azure_conv_train"`, when evaluating on "azure_conv_test").

    Args:
      policies: `{label: told -> policy}`, a factory of the policy told price `told`
        (`policies.autoscaling.told_price`).
      prices: the candidate told prices.

    Returns:
      `{label: {"price", "feasible", "tuning": {price: {cost, p99_latency}}}}` plus the
      autoscalers' tuning results under key "autoscalers".
    """

    prices = [float(p) for p in prices]
    pols = {o: P.get(o, env=env, params=params) for o in AUTOSCALERS}
    names = {}
    for label, make in policies.items():
        for p in prices:
            names[f"{label}@{p:g}"] = (label, p)
            pols[f"{label}@{p:g}"] = make(p)
    res = evaluate_autoscalers(env, params, pols, tuning_key(eval_key), num_envs, num_steps,
                               windows=windows)
    keep = ("cost", "p99_latency", "mean_latency", "gpu_hours")
    out: dict = {"autoscalers": {o: {k: res[o][k] for k in keep} for o in AUTOSCALERS}}
    for label in policies:
        cands = {n: p for n, (lab, p) in names.items() if lab == label}
        price, _, feasible = choose_told_price(res, cands)
        out[label] = {"price": price, "feasible": feasible,
                      "tuning": {p: {k: res[n][k] for k in keep} for n, p in cands.items()}}
    return out
