"""jaxserve-autoscale: autoscalers on the cost-latency plane of Autoscaling-v0.

Example::

    jaxserve-autoscale --run runs/as-s0 --run runs/as-s1 --out results/autoscale
    jaxserve-autoscale --set workload=azure_conv_test --windows 1600 --run runs/az-s0

Evaluates every fixed replica count, the HPA-, Knative- and Ray-Serve-style autoscalers
(`jaxserve.policies`, kind "autoscaling"; Ray Serve twice: its default target of 2 ongoing
requests and a target of one batch), the `scheduled` reference told the daily cycle (diurnal
load only; `--scheduled-grid` tuned by `evaluation.scaling.tune_scheduled` on disjoint
episodes) and, with `--run DIR` (repeatable), policies trained by `jaxserve-train`
(`agents.autoscaling`: reloaded, training-only settings dropped, adapted to the evaluation
scenario; a price-conditioned run is told the price chosen by
`evaluation.scaling.tune_told_price` from `--told-prices` on tuning episodes, or on windows of
`--tune-workload`), all on the same episodes (`evaluation.scaling.evaluate_autoscalers`;
`--windows S` replays disjoint S-second windows of a trace, one episode each). Prints paired
differences and a table sorted by cost with exact p99 latencies and the verdicts
(`evaluation.scaling.verdicts`), and writes `autoscale.csv`, `autoscale.json` and
`cost_latency.png` (replica-hours against mean latency). Replica-hours are the `gpu_hours`
fields: provisioned replica-seconds / 3600, not multiplied by the GPUs of a replica.
`--out` is checked before any work: a file, or a folder holding other files (unless
`--overwrite`), is refused. Errors print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

import jaxserve
from jaxserve.agents.autoscaling import as_evaluated, evaluation_overrides, load_run, price_conditioned
from jaxserve import policies as P
from jaxserve import traces as T
from jaxserve.core.sources import params_trace
from jaxserve.evaluation.scaling import (AUTOSCALERS, PAIRED_METRICS, evaluate_autoscalers,
                                         paired_comparisons, tune_scheduled, tune_told_price,
                                         verdicts)
from jaxserve.evaluation.serialize import to_jsonable
from jaxserve.scripts.cli import CLIError as _CLIError
from jaxserve.scripts.cli import Parser as _Parser
from jaxserve.scripts.cli import output_dir, parse_pairs, run_cli

COLUMNS = ("cost", "cost_ci95", "gpu_hours", "gpu_hours_ci95", "mean_replicas", "mean_latency",
           "mean_latency_ci95", "p99_latency", "p99_latency_ci95", "p99_latency_drops",
           "slo_violation_rate", "drop_rate", "in_flight")


def build_parser() -> _Parser:
    ap = _Parser(prog="jaxserve-autoscale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="Autoscaling-v0 override, repeatable (e.g. workload=azure_conv, "
                         "gpu_price=8)")
    ap.add_argument("--run", dest="runs", action="append", default=[], metavar="DIR",
                    help="a jaxserve-train run directory on Autoscaling-v0, repeatable")
    ap.add_argument("--num-envs", type=int, default=8,
                    help="episodes per policy (a replayed trace is deterministic: use "
                         "--windows for replicates)")
    ap.add_argument("--num-steps", type=int, default=None,
                    help="control intervals per episode (default: one episode / the trace)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scheduled-grid", default="4,4.5,5,5.5,6,6.5,7,7.5,8",
                    help="replicas_at_mean values for `scheduled`, chosen on tuning episodes "
                         "disjoint from the reported ones (one value: no tuning)")
    ap.add_argument("--told-prices", default="0.5,1,1.5,2,3,4",
                    help="prices a price-conditioned run (price_spread > 1) may be told; the "
                         "cheapest with p99 no worse than HPA's, Knative's and Ray Serve's on "
                         "tuning episodes (or windows) is reported")
    ap.add_argument("--windows", type=float, default=None, metavar="SECONDS",
                    help="replayed trace: one episode per disjoint window of this length")
    ap.add_argument("--tune-workload", default=None,
                    help="with --windows: the workload whose windows tune the told price "
                         "(default: X_train for workload X_test)")
    ap.add_argument("--out", default=None, help="directory for CSV, JSON and the plot")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into a non-empty --out that holds other files")
    ap.add_argument("--no-plot", action="store_true")
    return ap


def _floats(text: str, flag: str) -> list[float]:
    values = [float(c) for c in text.split(",") if c.strip()]
    if not values:
        raise _CLIError(f"{flag} needs at least one value")
    return values


def print_paired(paired: dict) -> None:
    for s, rows in paired.items():
        print(f"paired differences, {s} minus other (mean +- 95% half-width over episodes):")
        for o, d in rows.items():
            print(f"  vs {o:>12}: " + "; ".join(
                f"{m} {d[m]['mean']:+,.4g} +- {d[m]['ci']:,.3g}" for m in PAIRED_METRICS
                if m in d))


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    # deferred: the Agg backend must be chosen before pyplot is imported, and only where a
    # figure is drawn, not for every importer of this module
    import matplotlib  # deferred: see above
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: see above

    fig, ax = plt.subplots(figsize=(7, 4.5))
    fixed = sorted(((r["gpu_hours"], r["mean_latency"], n) for n, r in results.items()
                    if n.startswith("fixed-")))
    ax.plot([f[0] for f in fixed], [f[1] for f in fixed], "-o", color="0.5",
            label="fixed replica counts")
    for x, y, n in fixed:
        ax.annotate(n.split("-")[1], (x, y), textcoords="offset points", xytext=(4, 4),
                    fontsize=8, color="0.4")
    markers = iter("s^vD*Ph")
    for n, r in results.items():
        if n.startswith("fixed-"):
            continue
        ax.errorbar(r["gpu_hours"], r["mean_latency"], yerr=r["mean_latency_ci95"]
                    if np.isfinite(r["mean_latency_ci95"]) else None,
                    fmt=next(markers, "o"), ms=8, label=n, capsize=3)
    ax.set_xlabel("replica-hours per episode")
    ax.set_ylabel("mean latency (s)")
    lat = [r["mean_latency"] for r in results.values()]
    ax.set_ylim(0, min(max(lat) * 1.05, 3 * np.median(lat)))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# What `run` writes into --out (a folder holding only these is an earlier run: replaced).
OUTPUTS = ("autoscale.csv", "autoscale.json", "cost_latency.png")


def run(args) -> int:


    out = output_dir(args.out or None, "--out", OUTPUTS, overwrite=args.overwrite)
    if args.num_envs < 1:
        raise _CLIError("--num-envs must be >= 1")
    overrides = parse_pairs(args.overrides, "--set")
    learned = [load_run(d) for d in args.runs]
    # Every policy shares one environment: the registry's scenario with the first run's
    # non-training settings; the learned runs are adapted to it (`as_evaluated`).
    if learned:
        overrides = evaluation_overrides(learned[0][1], overrides)
    env, params = jaxserve.make("Autoscaling-v0", **overrides)
    for label, res in learned:
        if res.env.num_actions != env.num_actions:
            raise _CLIError(f"run {label} was trained with another action space")
    key = jax.random.key(args.seed)
    trace = params_trace(params.serving)
    windows = None
    if args.windows is not None:
        if trace is None:
            raise _CLIError("--windows needs a replayed trace (--set workload=...)")
        windows = T.windows(trace, args.windows, by="time")
    pols = {f"fixed-{n}": P.get("fixed", env=env, params=params, replicas=n)
            for n in range(1, env.max_replicas + 1)}
    for n in AUTOSCALERS:
        pols[n] = P.get(n, env=env, params=params)
    pols["ray_serve(target=B)"] = P.get("ray_serve", env=env, params=params,
                                        target_ongoing_requests=None)
    sched_c, sched_tuning = None, {}
    if trace is None:  # `scheduled` is told the diurnal cycle; a replay has none
        sched_c, sched_tuning = tune_scheduled(env, params, key, _floats(
            args.scheduled_grid, "--scheduled-grid"), args.num_envs, args.num_steps)
        pols["scheduled"] = P.get("scheduled", env=env, params=params,
                                  replicas_at_mean=sched_c)
    conditioned = {label: (lambda p, r=res: as_evaluated(r, params, p))
                   for label, res in learned if price_conditioned(res)}
    told = {}
    prices = _floats(args.told_prices, "--told-prices")
    if conditioned and trace is None:  # tuning episodes: tuning_key(key), disjoint streams
        told = tune_told_price(env, params, key, conditioned, prices, args.num_envs,
                               args.num_steps)
    elif conditioned:  # a replay is tuned on a disjoint part of the trace, never on itself
        workload = str(overrides.get("workload", ""))
        tune = args.tune_workload or workload.replace("_test", "_train")
        if not tune or tune == workload:
            raise _CLIError("tuning a told price on a replay needs a disjoint part of the "
                            "trace: --tune-workload (e.g. azure_conv_train for azure_conv_test)")
        tune_env, tune_params = jaxserve.make("Autoscaling-v0", **{**overrides, "workload": tune})
        tune_trace = params_trace(tune_params.serving)
        span = float(tune_trace.arrival_s[-1]) + 1.0
        told = tune_told_price(tune_env, tune_params, key, conditioned, prices,
                               windows=T.windows(tune_trace, args.windows or span, by="time"))
    if told:
        print_tuning(told)
    for label, res in learned:
        pols[label] = as_evaluated(res, params, told[label]["price"] if label in told else None)
    t0 = time.perf_counter()
    results, per_env = evaluate_autoscalers(env, params, pols, key, args.num_envs,
                                            args.num_steps, episodes=True, windows=windows)
    wall = time.perf_counter() - t0
    ver = verdicts(results)
    subjects = [label for label, _ in learned] + ([] if sched_c is None else ["scheduled"])
    paired = paired_comparisons(per_env, subjects)
    print_paired(paired)
    first = next(iter(results.values()))
    print_table(results, ver, f"Autoscaling-v0 {overrides or ''}: {first['num_envs']} episodes "
                f"of {first['intervals']:.0f} intervals ({wall:.0f} s)")
    if out is not None:
        with open(out / "autoscale.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["policy", *COLUMNS])
            for n, r in results.items():
                w.writerow([n, *[r.get(k, float("nan")) for k in COLUMNS]])
        doc = {"command": "jaxserve-autoscale " + " ".join(sys.argv[1:]),
               "overrides": overrides, "num_envs": first["num_envs"], "wall_s": wall,
               "results": results, "verdicts": ver, "paired": paired,
               "scheduled_tuning": sched_tuning, "told_price_tuning": told,
               "per_episode": per_env}
        (out / "autoscale.json").write_text(json.dumps(to_jsonable(doc), indent=1))
        if not args.no_plot:
            plot(results, out / "cost_latency.png", f"Autoscaling-v0 {overrides or ''}")
        print(f"wrote {out}/ (autoscale.csv, autoscale.json"
              + ("" if args.no_plot else ", cost_latency.png") + ")")
    return 0


def print_tuning(told: dict) -> None:
    a = told["autoscalers"]
    print("told-price tuning (tuning episodes): autoscalers' p99 "
          + ", ".join(f"{o} {a[o]['p99_latency']:.1f} s" for o in a))
    for label, t in told.items():
        if label == "autoscalers":
            continue
        rows = "; ".join(f"{p:g}: cost {r['cost']:,.0f} p99 {r['p99_latency']:.1f}"
                         for p, r in t["tuning"].items())
        met = "p99 met" if t["feasible"] else "none met the p99: lowest p99"
        print(f"  {label}: told {t['price']:g} ({met}); {rows}")


def print_table(results: dict, ver: dict, title: str) -> None:

    t = Table(title=title)
    for col in ("policy", "cost (req-s)", "replica-hours", "replicas", "mean latency (s)",
                "p99 (s)", "p99 with drops", "SLO violated", "drops", "< every fixed",
                "< HPA, KN, Ray at <= p99", "below frontier"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    yes = {True: "yes", False: "no", None: "-"}
    for n, r in sorted(results.items(), key=lambda kv: kv[1]["cost"]):
        v = ver.get(n, {})
        t.add_row(n, f"{r['cost']:,.0f}", f"{r['gpu_hours']:.2f}", f"{r['mean_replicas']:.2f}",
                  f"{r['mean_latency']:.1f}", f"{r.get('p99_latency', float('nan')):.1f}",
                  f"{r.get('p99_latency_drops', float('nan')):.1f}",
                  f"{100 * r['slo_violation_rate']:.1f}%",
                  f"{100 * r['drop_rate']:.2f}%", yes[v.get("cheaper_than_every_fixed")],
                  yes[v.get("beats_autoscalers")], yes[v.get("below_fixed_frontier")])
    Console(width=max(Console().width, 140)).print(t)


def main(argv: list[str] | None = None) -> int:
    """Console entry point (`jaxserve-autoscale`); returns the exit status."""
    return run_cli("jaxserve-autoscale", lambda: run(build_parser().parse_args(argv)))

if __name__ == "__main__":
    sys.exit(main())
