"""Experiment (b): one GPU (Batching-v0) from light load to near saturation, and a scenario
where the SMDP optimum beats every static setting; PPO and REINFORCE against greedy, a
size-or-timeout batcher, tuned_static and smdp_optimal."""

from __future__ import annotations

import numpy as np

from agents.experiments import scenarios as S
from jaxserve.evaluation.plots import axes_row
from agents.experiments.common import (LATENCY, Context, Section, fmt, fmt_diff,
                                       learned_dict, made_by, metric_of, paired_across_seeds,
                                       table, train_scenarios)
from agents.experiments.registry import experiment
from jaxserve import policies
from jaxserve.core.sources import tuning_key
from jaxserve.evaluation import evaluate_many, tune_static
from jaxserve.evaluation.capacity import service_capacity
from jaxserve.evaluation.stats import paired_difference
from jaxserve.policies.batching import default_grid

BASELINES = ("greedy", "size_or_timeout", "tuned_static", "smdp_optimal")


def batching_baselines(env, params, key, budget) -> tuple[dict, dict]:
    """The four baselines of (b), fitted and tuned on `tuning_key(key)` streams.

    size_or_timeout: dispatch at 8 waiting or when the head has waited one mean
    single-request service time (a common untuned rule). Returns (policies, facts).
    """
    tk = tuning_key(key)
    smdp = policies.get("smdp_optimal", env=env, params=params, key=tk)
    tuned, grid = tune_static(env, params, tk, num_envs=budget.tune_envs,
                              num_steps=budget.tune_steps,
                              compare_tables={"smdp_optimal": smdp.info["table"]})
    _, taus = default_grid(params)
    sot = policies.get("static", max_batch=8, timeout=float(taus[3]))
    best_static = next(r for r in grid if r["policy"] == "static")
    smdp_row = next(r for r in grid if r["policy"] == "smdp_optimal")
    facts = {"tuned": (tuned.info["max_batch"], tuned.info["timeout"]),
             "sot_timeout": float(taus[3]),
             "smdp_table": np.asarray(smdp.info["table"])[:8].tolist(),
             "tuning_gap": paired_difference(smdp_row["per_env_cost"],
                                             best_static["per_env_cost"])}
    return {"greedy": policies.get("greedy"), "size_or_timeout": sot, "tuned_static": tuned,
            "smdp_optimal": smdp}, facts


@experiment("b", "One GPU: learned batchers vs tuned static and the SMDP optimum")
def batching(ctx: Context) -> Section:
    ALGOS = ctx.budget.algos
    b = ctx.budget
    scen = {f"mid, load {x:g}": S.batching_mid(x) for x in b.batching_loads}
    scen["affine, load %.2f" % (S.AFFINE_RATE / service_capacity(S.batching_affine()[1]))] = \
        S.batching_affine()
    env0 = next(iter(scen.values()))[0]
    plist = [p for _, p in scen.values()]
    trained = {a: train_scenarios("Batching-v0", env0, plist, a, b.seeds, b.batching_steps,
                                  ctx)[0] for a in ALGOS}
    lat_rows, diff_rows, data, curves = [], [], {}, {}
    for i, (name, (env, params)) in enumerate(scen.items()):
        key = ctx.eval_key(30 + i)
        ctx.log(f"  tuning and evaluating (b) {name}")
        base, facts = batching_baselines(env, params, key, b)
        learned = {a: trained[a][i] for a in ALGOS}
        res = evaluate_many(env, params, {**base, **learned_dict(learned)}, key, b.eval_envs,
                            b.eval_steps, warmup=b.warmup)
        rate = float(np.asarray(params.arrivals.rates)[0])
        lat_rows.append([f"{name} ({rate:.3g} req/s)"]
                        + [fmt(*metric_of(res, n, LATENCY)) for n in list(ALGOS) + list(BASELINES)])
        smdp_vs_tuned = paired_difference(res["smdp_optimal"]["per_env"][LATENCY],
                                          res["tuned_static"]["per_env"][LATENCY])
        tg = facts["tuning_gap"]
        diff_rows.append([name] + [fmt_diff(paired_across_seeds(res, a, ref))
                                   for a in ALGOS for ref in ("tuned_static", "smdp_optimal")]
                         + [fmt(smdp_vs_tuned["mean"], smdp_vs_tuned["ci"]),
                            fmt(tg["mean"], tg["ci"]),
                            f"B={facts['tuned'][0]}, tau={facts['tuned'][1]:.3g} s",
                            str(facts["smdp_table"])])
        data[name] = {n: metric_of(res, n, LATENCY) for n in list(ALGOS) + list(BASELINES)}
        data[name]["smdp_minus_tuned_eval"] = smdp_vs_tuned["mean"]
        data[name]["smdp_minus_best_static_tuning"] = tg["mean"]
        curves[name] = data[name]
    cols = list(ALGOS) + list(BASELINES)
    body = "\n\n".join([
        f"Scenarios: {S.BATCHING_REASON}. Loads are fractions of full-batch capacity. "
        f"tuned_static = the best (B, tau) of `default_grid` (B in powers of two up to 16, tau "
        f"in 0-4 x the mean single-request time) by cost per request on {b.tune_envs} x "
        f"{b.tune_steps}-request *tuning* streams; smdp_optimal solved for Poisson arrivals "
        f"from tuning-key samples; size_or_timeout = static(B = 8, tau = one mean "
        f"single-request time), untuned; greedy = dispatch whatever waits (B = 16, tau = 0). "
        f"Evaluation: {b.eval_envs} envs x {b.eval_steps} requests (warm-up {b.warmup}) on "
        f"fresh streams; learned: greedy policy, mean over {len(b.seeds)} seeds ± 95% CI across"
        f" seeds ({b.batching_steps} training steps each, all scenarios and seeds in one "
        f"program per algorithm).",
        made_by(ctx, "b"),
        "Drop-inclusive mean latency (s):",
        table(["scenario"] + cols, lat_rows),
        "Paired differences of drop-inclusive mean latency (s; learned rows across seeds) and "
        "what the baselines chose. 'SMDP - tuned (eval)': paired over evaluation envs; "
        "'SMDP - best static (tuning)': the env cost per request on the tuning streams, where "
        "both were chosen (negative = the SMDP optimum beats every static setting of the "
        "grid):",
        table(["scenario"] + [f"{a} - {r}" for a in ALGOS for r in ("tuned_static", "smdp")]
              + ["SMDP - tuned (eval)", "SMDP - best static (tuning)", "tuned_static",
                 "SMDP table q=0..7"], diff_rows),
    ])

    def draw(path):
        _plot(curves, path)
    return Section("(b) One GPU: batching", body, figures={"results_batching.png": draw},
                   data=data)


def _plot(curves: dict, path) -> None:
    mids = [k for k in curves if k.startswith("mid")]
    loads = [float(k.split("load ")[1]) for k in mids]
    with axes_row(path, 1, (7, 4.2)) as (fig, (ax,)):
        for j, name in enumerate(curves[mids[0]]):
            if name not in BASELINES and name not in ("ppo", "reinforce"):
                continue
            y = np.array([curves[k][name][0] for k in mids])
            e = np.array([curves[k][name][1] for k in mids])
            ax.errorbar(np.array(loads) + 0.004 * j, y, yerr=np.nan_to_num(e), marker="o",
                        capsize=3, lw=1.0 if name in BASELINES else 2.2, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("offered load (fraction of full-batch capacity)")
        ax.set_ylabel("drop-inclusive mean latency (s)")
        ax.set_title("Batching-v0 ('mid' replica)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
