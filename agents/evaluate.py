"""Comparing a trained policy with the environment's heuristics on fresh arrivals.

`evaluate_run` is what `jaxserve-train` does after training: it builds the environment's
baselines (`baseline_policies`), evaluates them and the greedy learned policy on common
random numbers with a key that is never the training key, and `paired_verdicts` reads the
paired differences (learned - baseline) of the drop-inclusive mean latency.
"""

from __future__ import annotations

import time
from typing import Any

import jax

import jaxserve
from jaxserve.agents.envs import make_env
from jaxserve import policies as P
from jaxserve.core.sources import tuning_key
from jaxserve.envs.base import policy_kind
from jaxserve.evaluation.evaluate import paired_table
from jaxserve.evaluation.scaling import evaluate_autoscalers

ROUTING_BASELINES = ("random", "round_robin", "jsq", "sed", "least_work_left", "sita",
                     "sita_prompt", "sita_predicted", "sita_tuned")
BATCHING_BASELINES = ("static", "tuned_static", "smdp_optimal")
AUTOSCALING_BASELINES = ("hpa", "knative", "ray_serve", "scheduled")  # plus "fixed-<n>" for every n
BASELINES = {"routing": ROUTING_BASELINES, "batching": BATCHING_BASELINES,
             "autoscaling": ("fixed",) + AUTOSCALING_BASELINES}
EVAL_SEED_OFFSET = 1_000_000
VERDICT_METRIC = "mean_latency_incl_drops"


def baseline_policies(kind: str, env, params, requested: str | None, tuning=None) -> dict:
    """`{label: Policy}` of the heuristics to compare (`requested`, or the env's defaults).

    Args:
      kind: the environment's policy kind (`env.policy_kind`).
      env, params: the environment and its parameters (fitted policies read them).
      requested: comma-separated policy names, or None for `BASELINES[kind]`. Autoscaling-v0
        labels `fixed-<n>` are the fixed count `n`; `fixed` alone means all of them.
      tuning: a tuning key, passed to the policies that fit or tune (their factory takes
        `key`); never an evaluation key.

    Raises:
      ValueError: an unknown policy or a bad fixed count.
    """

    names = ([n.strip() for n in requested.split(",") if n.strip()] if requested is not None
             else [n for n in BASELINES[kind] if n in P.names(kind)])
    pols = {}
    for n in names:
        if kind == "autoscaling" and n.startswith("fixed"):
            counts = range(1, env.max_replicas + 1) if n == "fixed" else [n[len("fixed-"):]]
            for c in counts:
                try:
                    pols[f"fixed-{int(c)}"] = P.get("fixed", env=env, params=params,
                                                    replicas=int(c))
                except ValueError as e:
                    raise ValueError(f"bad fixed count {n!r}: {e}") from None
            continue
        if n not in P.names(kind):
            raise ValueError(f"unknown {kind} policy {n!r}; choose from "
                             f"{', '.join(P.names(kind))}")
        opts = {"key": tuning} if tuning is not None and "key" in P.options(n, kind) else {}
        pols[n] = P.get(n, kind=kind, env=env, params=params, **opts)
    return pols


def paired_verdicts(results: dict, learned: str) -> dict:
    """`{baseline: {"difference": paired_difference(learned - baseline), "verdict": ...}}`.

    On the drop-inclusive mean latency (lower is better): "better" / "worse" when the paired
    95% Student-t CI excludes 0, else "no significant difference". `results` come from one
    `evaluate_many` call (common streams); policies whose label starts with `learned` are
    not compared with each other.
    """

    out = {}
    for name, row in paired_table(results, learned, (VERDICT_METRIC, "mean_latency",
                                                     "goodput")).items():
        if name.startswith(learned):
            continue
        # paired_table gives (baseline - learned); flip to learned - baseline.
        d = {m: {**v, "mean": -v["mean"], "low": -v["high"], "high": -v["low"]}
             for m, v in row.items()}
        main = d[VERDICT_METRIC]
        verdict = ("better" if main["significant"] and main["mean"] < 0 else
                   "worse" if main["significant"] else "no significant difference")
        out[name] = {"difference": d, "verdict": verdict}
    return out


def evaluate_run(result, *, seed: int, eval_seed: int | None = None, eval_envs: int = 16,
                 eval_steps: int | None = None, eval_overrides: dict[str, Any] | None = None,
                 policies: str | None = None, sampled: bool = False) -> tuple[dict, dict]:
    """Evaluates a trained policy and the environment's baselines on common random numbers.

    Args:
      result: an `agents.TrainResult` on a jaxserve environment with registered heuristics.
      seed: the training seed; the evaluation key must differ from it.
      eval_seed: evaluation seed (default `seed + EVAL_SEED_OFFSET`: fresh arrivals).
      eval_envs: replicates (environments, or Autoscaling-v0 episodes).
      eval_steps: requests per replicate (default 1000); Autoscaling-v0: control intervals
        (default one episode).
      eval_overrides: environment overrides for the evaluation only (e.g. train on a fitted
        MMPP, test on the replay); the observation and action spaces must not change.
      policies: comma-separated baselines (default: the env's, `BASELINES`).
      sampled: also evaluate the sampling (non-greedy) learned policy.

    Returns:
      `(results, info)`: `{label: metrics}` from `jaxserve.evaluate_many` (Autoscaling-v0:
      `evaluate_autoscalers`), the learned policy under `result.algo`; `info` records the
      evaluation seed, sizes, overrides, wall time and the policy labels.

    Raises:
      ValueError: the evaluation seed equals the training seed, the overrides change the
        spaces, or an unknown baseline.
    """


    env, params = result.env, result.env_params
    eval_overrides = dict(eval_overrides or {})
    if eval_overrides:
        env, params = make_env(result.env_name, {**result.env_overrides, **eval_overrides})
        if (env.observation_space(params).shape != result.env.observation_space(
                result.env_params).shape or env.num_actions != result.env.num_actions):
            raise ValueError("--eval-set changed the observation or action space; the learned "
                             "policy cannot act in that environment")

    kind = policy_kind(env)
    eval_seed = seed + EVAL_SEED_OFFSET if eval_seed is None else eval_seed
    if eval_seed == seed:
        raise ValueError("--eval-seed must differ from --seed (evaluate on fresh arrivals)")
    baselines = baseline_policies(kind, env, params, policies,
                                  tuning_key(jax.random.key(eval_seed)))
    pols = {result.algo: result.policy}
    if sampled:
        pols[result.algo + "-sampled"] = result.make_policy(greedy=False)
    pols.update(baselines)
    t0 = time.perf_counter()
    if kind == "autoscaling":
        results = evaluate_autoscalers(env, params, pols, jax.random.key(eval_seed),
                                       eval_envs, eval_steps)
    else:
        results = jaxserve.evaluate_many(env, params, pols, jax.random.key(eval_seed),
                                         eval_envs, eval_steps or 1000)
    info = {"eval_seed": eval_seed, "eval_envs": eval_envs, "eval_steps": eval_steps,
            "eval_overrides": eval_overrides,
            "eval_wall_s": time.perf_counter() - t0, "policies": list(pols)}
    return results, info
