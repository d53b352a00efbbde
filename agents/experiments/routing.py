"""Routing experiments: (a) the study-compatible scenario, (c) heterogeneous mixes (goodput at
high load and SLO capacity), (e) which requests the learned router sends where."""

from __future__ import annotations

import numpy as np

from jaxserve.agents.experiments import scenarios as S
from jaxserve.evaluation.plots import axes_row
from jaxserve.agents.experiments.common import (LATENCY, Context, Section, drops_of, fmt,
                                       fmt_diff, learned_dict, made_by, metric_of,
                                       paired_across_seeds, seed_names, table,
                                       train_scenarios)
from jaxserve.agents.experiments.registry import experiment
from jaxserve import policies
from jaxserve.core.sources import tuning_key
from jaxserve.evaluation import evaluate_many, sweep_rates
from jaxserve.evaluation.capacity import service_capacity

STUDY_BASELINES = ("round_robin", "jsq", "random")


def routing_heuristics(env, params, key, budget=None, names=None) -> dict:
    """Every registered non-oracle routing policy (or those of `names`), SITA fitted (and
    the tuned ones simulated) on `tuning_key(key)`; the simulation runs `budget.tune_envs` x
    `budget.tune_steps` requests (default: the policy's own)."""
    out = {}
    for name in policies.names("routing") if names is None else names:
        if "oracle" in name:
            continue  # oracles read true output lengths: references, not baselines
        opts = policies.options(name, kind="routing")
        kw = {"key": tuning_key(key)} if "key" in opts else {}
        if budget is not None and "num_envs" in opts:
            kw.update(num_envs=budget.tune_envs, num_steps=budget.tune_steps,
                      warmup=min(budget.warmup, budget.tune_steps // 8))
        out[name] = policies.get(name, kind="routing", env=env, params=params, **kw)
    return out


def _eval(ctx: Context, env, params, pols: dict, key, **kw) -> dict:
    b = ctx.budget
    return evaluate_many(env, params, pols, key, b.eval_envs, b.eval_steps, warmup=b.warmup, **kw)


def comparison_rows(res: dict, algos, heuristics, metrics=(LATENCY, "p99_latency", "goodput")):
    """Rows: each algorithm (across seeds) then each heuristic, with paired differences of
    the drop-inclusive latency of every algorithm against each heuristic."""
    rows = []
    for name in list(algos) + list(heuristics):
        row = [f"**{name}** ({len(seed_names(res, name))} seeds)" if name in algos else name]
        row += [fmt(*metric_of(res, name, m)) for m in metrics]
        row.append(fmt(drops_of(res, name)))
        for a in algos:
            row.append("" if name in algos else fmt_diff(paired_across_seeds(res, a, name)))
        rows.append(row)
    return rows


def comparison_header(algos, metrics=("drop-incl. mean latency (s)", "p99 (s)",
                                      "goodput (req/s)")):
    return (["policy", *metrics, "drops"]
            + [f"{a} - policy, drop-incl. latency (s, paired)" for a in algos])


# ----------------------------------------------------------------------------- (a)

@experiment("a", "Study-compatible scenario: two identical GPUs, weak baselines")
def study(ctx: Context) -> Section:
    ALGOS = ctx.budget.algos
    b = ctx.budget
    env, params = S.study()
    learned = {a: train_scenarios("Routing-v0", env, [params], a, b.seeds, b.routing_steps,
                                  ctx)[0][0] for a in ALGOS}
    key = ctx.eval_key(1)
    heur = {n: policies.get(n, kind="routing", env=env, params=params)
            for n in STUDY_BASELINES}
    ctx.log("  evaluating (a)")
    res = _eval(ctx, env, params, {**heur, **learned_dict(learned)}, key)
    rate = float(np.asarray(params.arrivals.rates)[0])

    metrics = ("throughput", "mean_latency", LATENCY, "p99_latency", "cost_per_request")
    header = ["policy", "throughput (req/s)", "mean latency, served (s)",
              "drop-incl. mean latency (s)", "p99 (s)", "env cost / request (s)", "drops"]
    rows = []
    for name in list(ALGOS) + list(heur):
        rows.append([name] + [fmt(*metric_of(res, name, m)) for m in metrics]
                    + [fmt(drops_of(res, name))])

    def per_seed(algo, metric):
        return np.array([np.nanmean(res[k]["per_env"][metric]) for k in seed_names(res, algo)])

    def ref(name, metric):
        return float(np.nanmean(res[name]["per_env"][metric]))

    comp = []
    for algo in ALGOS:
        tp, lat = per_seed(algo, "throughput"), per_seed(algo, LATENCY)
        r_rr = tp / ref("round_robin", "throughput")
        r_jsq = 100 * (tp / ref("jsq", "throughput") - 1)
        l_jsq = 100 * (1 - lat / ref("jsq", LATENCY))
        comp.append([algo, f"{r_rr.mean():.2f}x [{r_rr.min():.2f}, {r_rr.max():.2f}]",
                     f"{r_jsq.mean():+.1f}% [{r_jsq.min():+.1f}, {r_jsq.max():+.1f}]",
                     f"{l_jsq.mean():+.1f}% [{l_jsq.min():+.1f}, {l_jsq.max():+.1f}]"])
    comp.append(["the study (RL router)", "~3.5x", "+48%", "~+25%"])
    body = "\n\n".join([
        f"Scenario: {S.STUDY_REASON}; {rate:.3f} req/s. {b.eval_envs} environments x "
        f"{b.eval_steps} requests (first {b.warmup} excluded), common random numbers; learned "
        f"rows: mean over {len(b.seeds)} training seeds ± 95% CI across seeds; baseline rows: "
        f"± 95% CI across environments. 'env cost / request' is the environments' own "
        f"objective (time in system + {float(np.asarray(params.drop_penalty_s)):g} s per "
        f"drop, per request; the reward is minus it over latency_scale).",
        made_by(ctx, "a"),
        table(header, rows),
        "Against the study's headline numbers (per-seed range in brackets):",
        table(["", "throughput / round robin", "throughput vs JSQ",
               "drop-incl. latency lower than JSQ by"], comp),
        "Paired differences (drop-inclusive mean latency, learned - baseline):",
        table(["baseline"] + [f"{a} - baseline (s)" for a in ALGOS],
              [[h] + [fmt_diff(paired_across_seeds(res, a, h)) for a in ALGOS]
               for h in heur]),
    ])
    data = {"rate": rate, "latency": {n: metric_of(res, n, LATENCY)[0]
                                      for n in list(ALGOS) + list(heur)},
            "throughput": {n: metric_of(res, n, "throughput")[0]
                           for n in list(ALGOS) + list(heur)}}
    return Section("(a) Study-compatible scenario", body, data=data)


# ----------------------------------------------------------------------------- (c)

def capacity_from_sweep(rows: list[dict], slo: float) -> float:
    """Highest grid rate up to which every rate met the p99 SLO (drops infinitely late);
    0.0 when even the lowest missed it."""
    cap = 0.0
    for r in rows:
        if not (r["p99_with_drops"] <= slo):
            break
        cap = r["rate"]
    return cap


def train_mixes(ctx: Context):
    ALGOS = ctx.budget.algos
    """Trains both mixes (one program per algorithm); cached for (d) and (e)."""
    if "mixes" in ctx.cache:
        return ctx.cache["mixes"]
    b = ctx.budget
    scen = {m: S.routing_mix(m) for m in S.MIXES}
    envs = [e for e, _ in scen.values()]
    plist = [p for _, p in scen.values()]
    trained = {a: train_scenarios("Routing-v0", envs[0], plist, a, b.seeds, b.routing_steps,
                                  ctx) for a in ALGOS}
    out = {}
    for i, m in enumerate(scen):
        env, params = scen[m]
        out[m] = {"env": env, "params": params,
                  "learned": {a: trained[a][0][i] for a in ALGOS},
                  "curves": {a: trained[a][1]["episode_return"][i] for a in ALGOS},
                  "env_steps": trained[next(iter(ALGOS))][1]["env_steps"]}
    ctx.cache["mixes"] = out
    return out


@experiment("c", "Routing on heterogeneous mixes: goodput at high load and SLO capacity")
def mixes(ctx: Context) -> Section:
    ALGOS = ctx.budget.algos
    b = ctx.budget
    trained = train_mixes(ctx)
    parts, data = [f"Scenarios: {S.MIX_REASON}. Heuristics: every registered routing policy "
                   f"except the oracles; SITA fitted on tuning streams "
                   f"(`tuning_key(eval key)`), disjoint from the evaluation streams."], {}
    sweeps = {}
    for j, (m, t) in enumerate(trained.items()):
        env, params = t["env"], t["params"]
        key = ctx.eval_key(10 + j)
        heur = routing_heuristics(env, params, key, ctx.budget)
        pols = {**heur, **learned_dict(t["learned"])}
        ctx.log(f"  evaluating (c) {m}")
        res = _eval(ctx, env, params, pols, key)
        t["heuristics"], t["results"], t["key"] = heur, res, key
        rate = float(np.asarray(params.arrivals.rates)[0])
        cap_full = service_capacity(params)
        rates = np.asarray(b.sweep_rates) * cap_full
        ctx.log(f"  capacity grid (c) {m}: {len(rates)} rates x {len(pols)} policies")
        sw = sweep_rates(env, params, pols, rates, ctx.eval_key(20 + j), b.sweep_envs,
                         b.sweep_steps, warmup=b.warmup)
        sweeps[m] = sw
        caps = {n: capacity_from_sweep(sw[n], S.CAPACITY_SLO_P99_S) for n in pols}
        cap_rows = []
        for name in list(ALGOS) + list(heur):
            if name in heur:
                cap_rows.append([name, f"{caps[name]:.3g}"])
            else:
                v = [caps[k] for k in seed_names(res, name)]
                cap_rows.append([f"**{name}**", f"{np.mean(v):.3g} (seeds: "
                                 + ", ".join(f"{x:.3g}" for x in v) + ")"])
        order = sorted(heur, key=lambda n: metric_of(res, n, LATENCY)[0])
        parts += [
            f"### Mix {m}: {rate:.3f} req/s (load {rate / cap_full:.2f} of full-batch "
            f"capacity {cap_full:.3f} req/s)",
            made_by(ctx, "c", f"{b.eval_envs} envs x {b.eval_steps} requests, warm-up "
                    f"{b.warmup}; SLO {float(np.asarray(params.slo_s)):g} s for goodput"),
            table(comparison_header(ALGOS), comparison_rows(res, ALGOS, order)),
            f"Capacity: highest rate of the grid {', '.join(f'{r:.3g}' for r in rates)} "
            f"req/s up to which p99 latency (drops as infinitely late) stays within "
            f"{S.CAPACITY_SLO_P99_S:g} s ({b.sweep_envs} envs x {b.sweep_steps} requests per "
            f"rate, `evaluation.capacity.sweep_rates`; learned routers are used unchanged at "
            f"every rate):",
            table(["policy", "capacity (req/s)"], cap_rows),
        ]
        data[m] = {"latency": {n: metric_of(res, n, LATENCY)[0] for n in list(ALGOS) + order},
                   "capacity": {n: caps[n] for n in caps}}

    def draw(path):
        _plot_sweeps(sweeps, path)
    return Section("(c) Routing on heterogeneous mixes", "\n\n".join(parts),
                   figures={"results_routing_capacity.png": draw}, data=data)


def _plot_sweeps(sweeps: dict, path) -> None:
    with axes_row(path, len(sweeps), (6 * len(sweeps), 4.2)) as (fig, axes):
        for ax, (m, sw) in zip(axes, sweeps.items()):
            groups: dict = {}
            for name, rows in sw.items():
                group = name.split("-s")[0] if "-s" in name else name
                groups.setdefault(group, []).append(rows)
            for name, runs in groups.items():
                rates = [r["rate"] for r in runs[0]]
                p99 = np.mean([[min(r["p99_with_drops"], 1e4) for r in rows]
                               for rows in runs], 0)
                learned = len(runs) > 1 or name in ("ppo", "reinforce")
                ax.plot(rates, p99, marker="o", lw=2.4 if learned else 1.0,
                        label=name + (" (mean of seeds)" if learned else ""))
            ax.axhline(S.CAPACITY_SLO_P99_S, color="k", ls="--", lw=0.8)
            ax.set_yscale("log")
            ax.set_xlabel("arrival rate (req/s)")
            ax.set_ylabel("p99 latency, drops as infinite (s)")
            ax.set_title(m)
            ax.grid(alpha=0.3)
        axes[-1].legend(fontsize=7)


# ----------------------------------------------------------------------------- (e)

@experiment("e", "Where it wins: the per-GPU short/long mix")
def class_mix(ctx: Context) -> Section:
    ALGOS = ctx.budget.algos
    trained = train_mixes(ctx)
    parts, data, mixes_for_plot = [], {}, {}
    for m, t in trained.items():
        if "results" not in t:
            ctx.log(f"  evaluating (e) {m} (experiment c did not run)")
            key = ctx.eval_key(10 + list(trained).index(m))
            t["heuristics"] = routing_heuristics(t["env"], t["params"], key, ctx.budget)
            t["results"] = _eval(ctx, t["env"], t["params"],
                                 {**t["heuristics"], **learned_dict(t["learned"])}, key)
        res = t["results"]
        names = [n for n in ("sed", "jsq", "sita") if n in res]
        gpus = S.MIXES[m]
        rows, mixes_for_plot[m] = [], {}
        for name in list(ALGOS) + names:
            keys = seed_names(res, name) if name in ALGOS else [name]
            mix = np.sum([np.asarray(res[k]["class_mix"], np.float64) for k in keys], axis=0)
            mixes_for_plot[m][name] = mix
            long_share = mix[:, -1] / np.maximum(mix.sum(1), 1)
            long_where = mix[:, -1] / max(mix[:, -1].sum(), 1)
            lat, _ = metric_of(res, name, LATENCY)
            rows.append([name, *[f"{100 * s:.0f}% / {100 * w:.0f}%"
                                 for s, w in zip(long_share, long_where)], fmt(lat)])
        header = ["policy"] + [f"GPU {g} ({gpus[g]}): long share of its requests / share of "
                               f"all long" for g in range(len(gpus))] + [
                                   "drop-incl. mean latency (s)"]
        parts += [f"### Mix {m}", made_by(ctx, "e", "the evaluation of (c); classes by true "
                                          "output length (a report, not something a policy "
                                          "saw); learned rows pool their seeds"),
                  table(header, rows),
                  "Paired differences, learned - heuristic (drop-inclusive latency):",
                  table(["heuristic"] + [f"{a} - heuristic (s)" for a in ALGOS],
                        [[h] + [fmt_diff(paired_across_seeds(res, a, h)) for a in ALGOS]
                         for h in names])]
        data[m] = {n: mixes_for_plot[m][n].tolist() for n in mixes_for_plot[m]}

    def draw(path):
        _plot_mix(mixes_for_plot, path)
    return Section("(e) Where it wins: which requests go where", "\n\n".join(parts),
                   figures={"results_class_mix.png": draw}, data=data)


def _plot_mix(mixes: dict, path) -> None:
    with axes_row(path, len(mixes), (6 * len(mixes), 4)) as (fig, axes):
        for ax, (m, by_policy) in zip(axes, mixes.items()):
            names = list(by_policy)
            g = by_policy[names[0]].shape[0]
            width = 0.8 / len(names)
            for i, name in enumerate(names):
                mix = by_policy[name]
                share = mix[:, -1] / np.maximum(mix.sum(1), 1)
                ax.bar(np.arange(g) + i * width, share, width, label=name)
            ax.set_xticks(np.arange(g) + 0.4 - width / 2)
            ax.set_xticklabels([f"GPU {i}\n{t}" for i, t in enumerate(S.MIXES[m])])
            ax.set_ylabel("share of the GPU's requests that are long")
            ax.set_title(m)
            ax.grid(alpha=0.3, axis="y")
        axes[-1].legend(fontsize=8)
