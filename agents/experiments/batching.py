"""Experiment (b): one GPU (Batching-v0) from light load to near saturation, and a scenario
where the SMDP optimum beats every static setting; PPO and REINFORCE against greedy, a
size-or-timeout batcher, tuned_static and smdp_optimal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve
from jaxserve.agents.defaults import make_config
from jaxserve.agents.experiments import scenarios as S
from jaxserve.agents.experiments.common import (LATENCY, Context, Section, fmt, fmt_diff, learned_dict,
                                       made_by, metric_of, paired_across_seeds, stack_params, table,
                                       train_scenarios)
from jaxserve.agents.experiments.registry import experiment
from jaxserve import policies
from jaxserve.core import arrivals as A
from jaxserve.core.sources import tuning_key
from jaxserve.core.stats import paired_difference
from jaxserve.core.types import GPUProfile
from jaxserve.evaluation import evaluate_many, tune_static
from jaxserve.evaluation.episodes import from_policy, run_episode
from jaxserve.evaluation.plots import axes_row
from jaxserve.policies.batching import default_grid
from jaxserve.policies.smdp import build_model, solve_smdp, static_table_gains

BASELINES = ("greedy", "size_or_timeout", "tuned_static", "smdp_optimal")
# The SMDP-vs-static comparison is paired over a larger, baseline-only evaluation (no learned
# policy in the program, so it is cheap): this many times the budget's envs and requests.
BASELINE_EVAL_SCALE = 4
# The exact scan behind the control-limit scenario (scenarios.py): T_k = 1 + a k s (a = the
# per-request share of a fixed 1 s batch cost), Poisson arrivals, 64 queue slots.
SCAN_BATCH = (2, 3, 4, 8, 16)
SCAN_PER_REQUEST = (0.0, 0.005, 0.02, 0.1)
SCAN_LOADS = (0.5, 0.7, 0.8, 0.9, 0.95)


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
    gains = static_table_gains(smdp.info["model"])
    best_table = min(gains, key=gains.get)
    facts = {"tuned": (tuned.info["max_batch"], tuned.info["timeout"]),
             "table_gap": (best_table, gains[best_table] / smdp.info["gain"] - 1.0),
             "sot_timeout": float(taus[3]),
             "smdp_table": np.asarray(smdp.info["table"])[:8].tolist(),
             "tuning_gap": paired_difference(smdp_row["per_env_cost"],
                                             best_static["per_env_cost"])}
    return {"greedy": policies.get("greedy"), "size_or_timeout": sot, "tuned_static": tuned,
            "smdp_optimal": smdp}, facts


def scan_static_gap() -> dict:
    """The exact scan of scenarios.py's control-limit reason: for T_k = 1 + a k s and every
    (B, a, load) of `SCAN_*`, the optimum's gain over the static rules that are queue-length
    tables (`static_table_gains`), an upper bound on its gain over every static rule.

    Returns: {"max_gap", "at" (B, a, load), "max_greedy_gap", "cases"}.
    """
    best, best_at, worst_greedy, n = -1.0, None, -1.0, 0
    for bmax in SCAN_BATCH:
        for a in SCAN_PER_REQUEST:
            gpu = GPUProfile(c0=1.0, alpha=a / 128, beta=0.0, gamma=0.0, max_batch=bmax,
                             queue_cap=64)
            for load in SCAN_LOADS:
                rate = load * bmax / (1.0 + a * bmax)
                _, p = jaxserve.make("Batching-v0", gpus=[gpu], arrival_rate=rate,
                                     tokens=A.fixed_tokens(128, 1))
                model = build_model(p)
                opt = solve_smdp(model).gain
                gains = static_table_gains(model)
                gap = min(gains.values()) / opt - 1.0
                worst_greedy = max(worst_greedy, gains[f"greedy {bmax}"] / opt - 1.0)
                if gap > best:
                    best, best_at = gap, (bmax, a, load)
                n += 1
    return {"max_gap": best, "at": best_at, "max_greedy_gap": worst_greedy, "cases": n}


def episode_objectives(env, params_list, key, num_envs: int, gamma: float,
                       discount_time_s: float) -> dict:
    """What a training episode (`max_steps_in_episode` decisions from reset) is worth under
    greedy and under always waiting (action 0, what the collapsed batchers learned), per
    scenario: the undiscounted return, the return discounted by simulated time
    (`gamma ** (elapsed / discount_time_s)`, as the agents train), the simulated seconds it
    spans and its drops; means over `num_envs` episodes on common keys. One program.

    Returns: `{"greedy" | "wait": [per scenario {"return", "discounted_return", "seconds",
    "drops"}]}`.
    """
    greedy = policies.get("greedy").fn
    steps = int(params_list[0].max_steps_in_episode)

    def fold(acc, st):
        ret, dret, disc, secs, drops = acc
        el = st.info["elapsed"]
        return (ret + st.reward, dret + disc * st.reward,
                disc * jnp.float32(gamma) ** (el / discount_time_s), secs + el,
                drops + st.info["dropped"]), None

    def one(params, wait, k):
        def pol(kk, obs, state, pp):
            return jnp.where(wait, 0, greedy(kk, obs, state, pp))
        z = jnp.float32(0.0)
        return run_episode(env, from_policy(pol, params), params, k, steps, fold=fold,
                           init=lambda o, s: (z, z, jnp.float32(1.0), z, z))[3]

    keys = jax.random.split(key, num_envs)
    run = jax.vmap(jax.vmap(jax.vmap(one, (None, None, 0)), (None, 0, None)), (0, None, None))
    out = jax.jit(run)(stack_params(params_list), jnp.array([False, True]), keys)
    ret, dret, _, secs, drops = (np.asarray(v) for v in out)  # (scenario, policy, env)
    return {pol: [{"return": float(ret[i, j].mean()), "discounted_return": float(
        dret[i, j].mean()), "seconds": float(secs[i, j].mean()), "drops": float(
        drops[i, j].mean())} for i in range(len(params_list))]
        for j, pol in enumerate(("greedy", "wait"))}


def collapse_rows(scen: dict, ctx: Context, num_envs: int):
    """Table rows: per scenario, greedy's and always-wait's training-episode objectives
    (`episode_objectives`) under the agents' discounting (`agents.defaults`)."""
    env0 = next(iter(scen.values()))[0]
    cfg = make_config("ppo", "Batching-v0", env0, None, 0)
    obj = episode_objectives(env0, [p for _, p in scen.values()], ctx.eval_key(60), num_envs,
                             cfg.gamma, cfg.discount_time_s)
    rows = [[name] + [f"{x['return']:.0f} / {x['discounted_return']:.1f} / "
                      f"{x['seconds']:.0f} s / {x['drops']:.0f}"
                      for x in (obj["greedy"][i], obj["wait"][i])]
            for i, name in enumerate(scen)]
    return rows, cfg, obj


def verdict(data: dict, name: str, scan: dict) -> str:
    """The reading of the SMDP-vs-static table for scenario `name`, from its numbers."""
    r = data[name]
    d, ci = r["smdp_minus_tuned_eval"]
    pct, bound = -r["smdp_minus_tuned_eval_pct"], r["exact_table_gap_pct"]
    clear = d + ci < 0
    out = (f"**Verdict.** In '{name}' the SMDP optimum is {'faster' if d < 0 else 'not faster'}"
           f" than tuned_static on the evaluation streams by {pct:.2f}% ({fmt(d, ci)} s; the "
           f"95% CI {'excludes' if clear else 'includes'} 0). The target was a few percent; "
           f"the exact bounds say this model does not allow that anywhere the scan looked "
           f"(at most {100 * scan['max_gap']:.2f}%).")
    if pct > bound:
        b, tau = r["tuned"]
        out += (f" The measured margin exceeds this scenario's exact bound ({bound:.2f}%): "
                f"the setting tuned on the small tuning streams (B = {b}, tau = {tau:.3g} s) "
                f"is not the grid's best, and the static rule '{r['exact_table_best']}' "
                f"(static(B, inf) for 'wait', static(B, 0) for 'greedy') is within "
                f"{bound:.2f}% of the optimum: against the *best* static setting the optimum "
                f"gains at most that.")
    return out


@experiment("b", "One GPU: learned batchers vs tuned static and the SMDP optimum")
def batching(ctx: Context) -> Section:
    ALGOS = ctx.budget.algos
    b = ctx.budget
    scen = {f"mid, load {x:g}": S.batching_mid(x) for x in b.batching_loads}
    scen[S.CONTROL_LIMIT_NAME] = S.batching_control_limit()
    env0 = next(iter(scen.values()))[0]
    plist = [p for _, p in scen.values()]
    ctx.log("  exact scan of the SMDP's gain over static rules; training-episode objectives")
    scan = scan_static_gap()
    c_rows, cfg, obj = collapse_rows({k: v for k, v in scen.items() if k.startswith("mid")},
                                     ctx, b.eval_envs)
    trained = {a: train_scenarios("Batching-v0", env0, plist, a, b.seeds, b.batching_steps,
                                  ctx)[0] for a in ALGOS}
    lat_rows, diff_rows, smdp_rows, data, curves = [], [], [], {}, {}
    big_envs, big_steps = BASELINE_EVAL_SCALE * b.eval_envs, BASELINE_EVAL_SCALE * b.eval_steps
    for i, (name, (env, params)) in enumerate(scen.items()):
        key = ctx.eval_key(30 + i)
        ctx.log(f"  tuning and evaluating (b) {name}")
        base, facts = batching_baselines(env, params, key, b)
        learned = {a: trained[a][i] for a in ALGOS}
        res = evaluate_many(env, params, {**base, **learned_dict(learned)}, key, b.eval_envs,
                            b.eval_steps, warmup=b.warmup)
        big = evaluate_many(env, params, base, ctx.eval_key(45 + i), big_envs, big_steps,
                            warmup=BASELINE_EVAL_SCALE * b.warmup)
        rate = float(np.asarray(params.arrivals.rates)[0])
        lat_rows.append([f"{name} ({rate:.3g} req/s)"]
                        + [fmt(*metric_of(res, n, LATENCY)) for n in list(ALGOS) + list(BASELINES)])
        tg = facts["tuning_gap"]
        diff_rows.append([name] + [fmt_diff(paired_across_seeds(res, a, ref))
                                   for a in ALGOS for ref in ("tuned_static", "smdp_optimal")])
        vs = {ref: paired_difference(big["smdp_optimal"]["per_env"][LATENCY],
                                     big[ref]["per_env"][LATENCY])
              for ref in ("tuned_static", "greedy")}
        tuned_lat = metric_of(big, "tuned_static", LATENCY)[0]
        tb, tgap = facts["table_gap"]
        smdp_rows.append([
            name, f"B={facts['tuned'][0]}, tau={facts['tuned'][1]:.3g} s",
            str(facts["smdp_table"]), fmt(*metric_of(big, "smdp_optimal", LATENCY)),
            fmt(tuned_lat), fmt(vs["tuned_static"]["mean"], vs["tuned_static"]["ci"])
            + f" ({100 * vs['tuned_static']['mean'] / tuned_lat:+.2f}%)",
            fmt(vs["greedy"]["mean"], vs["greedy"]["ci"]),
            fmt(tg["mean"], tg["ci"]), f"{100 * tgap:.2f}% ({tb})"])
        data[name] = {n: metric_of(res, n, LATENCY) for n in list(ALGOS) + list(BASELINES)}
        data[name]["smdp_minus_tuned_eval"] = (vs["tuned_static"]["mean"],
                                               vs["tuned_static"]["ci"])
        data[name]["smdp_minus_tuned_eval_pct"] = 100 * vs["tuned_static"]["mean"] / tuned_lat
        data[name]["smdp_minus_greedy_eval"] = (vs["greedy"]["mean"], vs["greedy"]["ci"])
        data[name]["smdp_minus_best_static_tuning"] = (tg["mean"], tg["ci"])
        data[name]["exact_table_gap_pct"] = 100 * tgap
        data[name]["exact_table_best"] = tb
        data[name]["tuned"] = list(facts["tuned"])
        curves[name] = data[name]
    data["exact_scan"], data["training_episodes"] = scan, obj
    cols = list(ALGOS) + list(BASELINES)
    body = "\n\n".join([
        f"Scenarios: {S.BATCHING_REASON}. Loads are fractions of full-batch capacity. "
        f"tuned_static = the best (B, tau) of `default_grid` (B in powers of two up to the "
        f"batch limit, tau in 0-4 x the mean single-request time and inf) by cost per request "
        f"on {b.tune_envs} x {b.tune_steps}-request *tuning* streams; smdp_optimal solved for "
        f"Poisson arrivals from tuning-key samples; size_or_timeout = static(B = 8, tau = one "
        f"mean single-request time), untuned; greedy = dispatch whatever waits (tau = 0). "
        f"Evaluation: {b.eval_envs} envs x {b.eval_steps} requests (warm-up {b.warmup}) on "
        f"fresh streams; learned: greedy policy, mean over {len(b.seeds)} seeds ± 95% CI across"
        f" seeds ({b.batching_steps} training steps each, all scenarios and seeds in one "
        f"program per algorithm).",
        made_by(ctx, "b"),
        "Drop-inclusive mean latency (s):",
        table(["scenario"] + cols, lat_rows),
        "Paired differences of drop-inclusive mean latency, learned - baseline (s; across "
        "seeds):",
        table(["scenario"] + [f"{a} - {r}" for a in ALGOS for r in ("tuned_static", "smdp")],
              diff_rows),
        f"**The SMDP optimum against every static setting.** Paired over a larger "
        f"baseline-only evaluation ({big_envs} envs x {big_steps} requests, warm-up "
        f"{BASELINE_EVAL_SCALE * b.warmup}, fresh streams; ± 95% CI across envs; negative = "
        f"the SMDP optimum is faster). 'on tuning streams': SMDP - the best static of the grid"
        f", where the grid was searched (cost per request; the minimum over the grid's "
        f"noisy points, up to {len(default_grid(plist[0])[0]) * len(default_grid(plist[0])[1])},"
        f" favours static). 'exact bound': how much worse than the optimum the best static rule "
        f"that is a queue-length table (static(B, 0) or static(B, inf), any B) is, from the "
        f"SMDP's own exact policy evaluation: an upper bound on what the optimum can gain over "
        f"every static rule.",
        table(["scenario", "tuned_static", "SMDP table q=0..7", "smdp_optimal (s)",
               "tuned_static (s)", "SMDP - tuned", "SMDP - greedy", "on tuning streams",
               "exact bound"], smdp_rows),
        verdict(data, S.CONTROL_LIMIT_NAME, scan),
        f"Why the margin is small wherever one looks: the same exact bound over {scan['cases']}"
        f" single-GPU scenarios (T_k = 1 + a k s, B in {list(SCAN_BATCH)}, a in "
        f"{list(SCAN_PER_REQUEST)}, loads {list(SCAN_LOADS)}, Poisson arrivals) is at most "
        f"**{100 * scan['max_gap']:.2f}%** (at B = {scan['at'][0]}, a = {scan['at'][1]:g}, "
        f"load {scan['at'][2]:g}), and greedy alone is at most {100 * scan['max_greedy_gap']:.1f}%"
        f" worse than the optimum. With a linear time-in-system cost, waiting to fill a batch "
        f"buys little, and static rules with a finite timeout (which fire at the next "
        f"arrival, a proxy for 'one more request') recover part of even that bound. The "
        f"control-limit scenario sits in the region of the largest bounds (B = 3-4, a batch "
        f"cost nearly independent of its size, load 0.7-0.8), with a batch limit of 4 rather "
        f"than 3 as the more common setting.",
        f"**Training episodes (the learned batchers' collapse at high load).** A training "
        f"episode is {int(plist[0].max_steps_in_episode)} *decisions*; a wait lasts one "
        f"arrival gap, a dispatch a whole batch. Per episode from reset, greedy vs always "
        f"waiting: undiscounted return / return discounted by simulated time (gamma = "
        f"{cfg.gamma} per {cfg.discount_time_s:g} s, the agents' setting) / simulated time / "
        f"drops ({b.eval_envs} episodes each):",
        table(["scenario", "greedy", "always wait"], c_rows),
        "Reading: over a fixed number of decisions, always waiting spans a fraction of the "
        "simulated time, so near saturation its *undiscounted* episode return can beat "
        "greedy's (the episode-return learning curves then mislead); the time-discounted "
        "objective the agents optimise (truncation bootstrapped) always prefers greedy. The "
        "previous run of this section (commit 3de59fe, gamma 0.99 per 5 s, a ~500 s horizon) "
        "had PPO and REINFORCE collapse to always-wait at load 0.95 on every seed (623 s "
        "drop-inclusive against greedy's 76 s): a dispatch from a long queue costs every "
        "waiting request's time over a whole batch in one step, a wait costs one arrival gap "
        "and its drops come later, so dispatching wins the one-step advantage only once the "
        "critic has learned values of the order of cost rate x horizon, which a 500 s horizon "
        "makes large and slow to learn. `agents.defaults` now discounts 0.99 per 1 s (a ~100 s"
        " horizon, a few batch times); the tables above are trained with it.",
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
