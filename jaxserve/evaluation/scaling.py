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

Comparisons (host side): `verdicts` places each adaptive policy against the fixed-count
frontier (`frontier_latency`) and HPA; `paired_comparisons` gives paired per-episode
differences of `PAIRED_METRICS` against HPA, Knative, Ray Serve and every fixed count.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.envs.autoscaling import Autoscaling, AutoscalingParams
from jaxserve.evaluation.episodes import Step, from_policy, run_episode
from jaxserve.evaluation.evaluate import switch_policy
from jaxserve.evaluation.stats import paired_difference, t_halfwidth

SUMS = ("arrived", "completed", "dropped", "latency_sum", "slo_violations", "gpu_seconds",
        "in_system_time", "cost", "reward", "intervals")


def episode_totals(env: Autoscaling, policy: Callable, params: AutoscalingParams, key,
                   num_steps: int) -> dict[str, jax.Array]:
    """Runs one episode of `num_steps` intervals under `policy`; sums its per-interval info.

    The episode is not truncated inside the run (`max_steps_in_episode` is raised to cover it)
    and intervals after a natural termination are masked. Returns float32 totals (`SUMS`)
    plus `in_flight`, the requests left in the system at the end.
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
    cl = state.cluster
    totals["in_flight"] = (cl.queues.count + cl.servers.run_count).sum().astype(jnp.float32)
    return totals


@partial(jax.jit, static_argnames=("env", "policies", "num_steps"))
def _run(env, policies, params, keys, num_steps):
    def per_policy(i):
        pol = switch_policy(policies, i)
        return jax.vmap(lambda k: episode_totals(env, pol, params, k, num_steps))(keys)
    return jax.vmap(per_policy)(jnp.arange(len(policies)))


def per_episode(totals: dict, control_interval_s: float) -> dict[str, np.ndarray]:
    """Host-side `(E,)` per-episode metrics from episode totals (see the module docstring);
    episode `i` of every policy ran on the same streams, so pair them
    (`evaluation.stats.paired_difference`)."""
    t = {k: np.asarray(v, np.float64) for k, v in totals.items()}
    completed = np.maximum(t["completed"], 1.0)
    arrived = np.maximum(t["arrived"], 1.0)
    duration = np.maximum(t["intervals"] * control_interval_s, 1e-9)
    return {
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


def summarise(totals: dict, control_interval_s: float) -> dict:
    """Host-side per-policy metrics from `(E,)` episode totals (see the module docstring)."""
    t = {k: np.asarray(v, np.float64) for k, v in totals.items()}
    per_env = per_episode(totals, control_interval_s)
    out: dict = {"num_envs": int(t["cost"].shape[0]),
                 "intervals": float(t["intervals"].mean()),
                 "arrived": float(t["arrived"].mean()), "dropped": int(t["dropped"].sum())}
    for k, v in per_env.items():
        out[k] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
        out[k + "_ci95"] = t_halfwidth(v)
    return out


def evaluate_autoscalers(env: Autoscaling, params: AutoscalingParams,
                         policies: Mapping[str, Callable], key, num_envs: int = 8,
                         num_steps: int | None = None,
                         episodes: bool = False) -> dict[str, dict]:
    """Evaluates autoscaling policies on common random numbers (one compiled program).

    Args:
      env, params: an Autoscaling-v0 environment and its parameters.
      policies: `{name: policy}`, each `policy(key, obs, state, params) -> int32 action`.
      key: PRNG key; the same episodes for every policy.
      num_envs: independent episodes (replicates for the CIs).
      num_steps: control intervals per episode (default `max_steps_in_episode`; with a trace,
        default: enough to replay it and drain, its duration plus 10%, plus 40 intervals).
      episodes: also return the per-episode metrics, for paired comparisons.

    Returns:
      `{name: metrics}` (see the module docstring); with `episodes=True`, the pair
      `({name: metrics}, {name: per_episode metrics})`.

    Raises:
      ValueError: not an Autoscaling-v0 environment, no policies, or bad sizes.
    """
    if not isinstance(env, Autoscaling):
        raise ValueError(f"evaluate_autoscalers needs an Autoscaling-v0 environment, got "
                         f"{type(env).__name__}")
    if not policies:
        raise ValueError("policies must name at least one policy")
    if int(num_envs) < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
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
    names = list(policies)
    keys = jax.random.split(key, int(num_envs))
    totals = _run(env, tuple(policies[n] for n in names), params, keys, int(num_steps))
    per = {n: {k: v[i] for k, v in totals.items()} for i, n in enumerate(names)}
    summaries = {n: summarise(t, dt) for n, t in per.items()}
    if episodes:
        return summaries, {n: per_episode(t, dt) for n, t in per.items()}
    return summaries


# ----------------------------------------------------------------------- comparisons

PAIRED_METRICS = ("cost", "mean_latency", "slo_violation_rate", "gpu_hours")


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
    """For each non-fixed policy: cheaper than every fixed count / than HPA; below frontier."""
    fixed = {n: r for n, r in results.items() if n.startswith("fixed-")}
    out = {}
    for n, r in results.items():
        if n.startswith("fixed-"):
            continue
        front = frontier_latency(fixed, r["gpu_hours"])
        out[n] = {
            "cheaper_than_every_fixed": bool(all(r["cost"] < f["cost"] for f in fixed.values())),
            "cheaper_than_hpa": (bool(r["cost"] < results["hpa"]["cost"])
                                 if "hpa" in results and n != "hpa" else None),
            "frontier_latency_s": front,
            "below_fixed_frontier": bool(np.isfinite(front) and r["mean_latency"] < front),
        }
    return out


def paired_comparisons(per_env: dict, subjects: list[str]) -> dict:
    """Paired differences (subject - other, same episodes) of `PAIRED_METRICS` against HPA,
    Knative, Ray Serve and every fixed count: `{subject: {other: {metric: stats}}}`."""
    others = [n for n in per_env if n.startswith("fixed-")
              or n in ("hpa", "knative", "ray_serve")]
    return {s: {o: {m: paired_difference(per_env[s][m], per_env[o][m]) for m in PAIRED_METRICS}
                for o in others} for s in subjects if s in per_env}
