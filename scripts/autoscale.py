"""jaxserve-autoscale: autoscalers on the cost-latency plane of Autoscaling-v0.

Example::

    jaxserve-autoscale --set workload=azure_conv --run runs/as-ppo --out results/autoscale

Evaluates every fixed replica count, the HPA-, Knative- and Ray-Serve-style autoscalers
(`jaxserve.policies`, kind "autoscaling"; Ray Serve twice: its default target of 2 ongoing
requests and a target of one batch), the `scheduled` reference that is told the daily cycle
(its `replicas_at_mean` chosen from `--scheduled-grid` on tuning episodes,
`core.sources.tuning_key`, disjoint from the reported ones), and, with `--run DIR`
(repeatable), policies trained by `jaxserve-train` (reloaded from their checkpoints), all on
the same episodes (`jaxserve.evaluation.scaling.evaluate_autoscalers`). A run trained with a
longer decision interval (k x the evaluation's) decides every k-th interval and holds the
count in between (`policies.autoscaling.hold_every`); one trained with step actions is
re-expressed by target (`in_action_mode`), so the baselines keep the registry's scenario.
Training-only settings of a run (`TRAINING_ONLY`) are not carried into the evaluation.
Prints a table sorted by cost, says for each autoscaler whether it costs less than every fixed
count and than HPA and whether its point lies below the fixed-count frontier (its mean latency
under the piecewise-linear interpolation of the fixed counts' latency at the same
replica-hours), prints paired differences (same episodes, Student-t 95% half-widths) of the
learned runs and `scheduled` against every fixed count, HPA, Knative and Ray Serve, and writes
`autoscale.csv`, `autoscale.json` and `cost_latency.png` (replica-hours against mean
latency). Replica-hours are the `gpu_hours` fields: provisioned replica-seconds / 3600, not
multiplied by the GPUs of a replica.
Errors print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

import numpy as np

from jaxserve.evaluation.scaling import PAIRED_METRICS, paired_comparisons, verdicts
from jaxserve.evaluation.serialize import to_jsonable
from scripts.cli import CLIError as _CLIError
from scripts.cli import Parser as _Parser
from scripts.cli import run_cli
from scripts.cli import parse_pairs

COLUMNS = ("cost", "cost_ci95", "gpu_hours", "gpu_hours_ci95", "mean_replicas", "mean_latency",
           "mean_latency_ci95", "slo_violation_rate", "drop_rate", "in_flight")


def build_parser() -> _Parser:
    ap = _Parser(prog="jaxserve-autoscale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="Autoscaling-v0 override, repeatable (e.g. workload=azure_conv, "
                         "gpu_price=8)")
    ap.add_argument("--run", dest="runs", action="append", default=[], metavar="DIR",
                    help="a jaxserve-train run directory on Autoscaling-v0, repeatable")
    ap.add_argument("--num-envs", type=int, default=8,
                    help="episodes per policy (a replayed trace is deterministic: 2 suffice)")
    ap.add_argument("--num-steps", type=int, default=None,
                    help="control intervals per episode (default: one episode / the trace)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scheduled-grid", default="4,4.5,5,5.5,6,6.5,7,7.5,8",
                    help="replicas_at_mean values for `scheduled`, chosen on tuning episodes "
                         "disjoint from the reported ones (one value: no tuning)")
    ap.add_argument("--out", default=None, help="directory for CSV, JSON and the plot")
    ap.add_argument("--no-plot", action="store_true")
    return ap


def load_run(run_dir: Path):
    """Reloads a finished `jaxserve-train` run: `(label, TrainResult)`."""
    import agents

    meta_path = run_dir / "results.json"
    if not meta_path.exists():
        raise _CLIError(f"{run_dir} has no results.json: not a jaxserve-train run directory")
    meta = json.loads(meta_path.read_text())
    if meta.get("env") != "Autoscaling-v0":
        raise _CLIError(f"{run_dir} trained {meta.get('env')!r}, not Autoscaling-v0")
    overrides = meta["env_overrides"]
    if any(isinstance(v, dict) and "repr" in v for v in overrides.values()):
        raise _CLIError(f"{run_dir} used overrides that cannot be rebuilt from JSON")
    cfg = {k: v for k, v in meta["config"].items()
           if k not in ("type", "total_timesteps", "seed", "num_envs")}
    if "hidden_sizes" in cfg:
        cfg["hidden_sizes"] = tuple(cfg["hidden_sizes"])
    if cfg.get("set_dims") is not None:
        cfg["set_dims"] = tuple(cfg["set_dims"])
    result = agents.train("Autoscaling-v0", overrides, meta["algo"],
                          meta["config"]["total_timesteps"], meta["seed"],
                          num_envs=meta["config"]["num_envs"], progress=False, out_dir=run_dir,
                          resume=True, **cfg)
    return f"{meta['algo']}:{run_dir.name}", result


TRAINING_ONLY = ("control_interval_s", "max_steps_in_episode", "random_phase", "random_initial",
                 "invalid_penalty_s", "action_mode")


def tune_scheduled(env, params, eval_key, args) -> tuple[float, dict]:
    """`scheduled`'s `replicas_at_mean`, the cheapest of `--scheduled-grid` on episodes drawn
    from `tuning_key(eval_key)` (disjoint from the reported ones); `(choice, {c: cost})`."""
    from jaxserve import policies as P
    from jaxserve.core.sources import tuning_key
    from jaxserve.evaluation.scaling import evaluate_autoscalers

    grid = [float(c) for c in args.scheduled_grid.split(",") if c.strip()]
    if not grid:
        raise _CLIError("--scheduled-grid needs at least one value")
    if len(grid) == 1:
        return grid[0], {}
    pols = {c: P.get("scheduled", env=env, params=params, replicas_at_mean=c) for c in grid}
    res = evaluate_autoscalers(env, params, {str(c): p for c, p in pols.items()},
                               tuning_key(eval_key), args.num_envs, args.num_steps)
    costs = {c: res[str(c)]["cost"] for c in grid}
    return min(costs, key=costs.get), costs


def print_paired(paired: dict) -> None:
    for s, rows in paired.items():
        print(f"paired differences, {s} minus other (mean +- 95% half-width over episodes):")
        for o, d in rows.items():
            print(f"  vs {o:>12}: " + "; ".join(
                f"{m} {d[m]['mean']:+,.4g} +- {d[m]['ci']:,.3g}" for m in PAIRED_METRICS))


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def run(args) -> int:
    import jax

    import jaxserve
    from jaxserve import policies as P
    from jaxserve.evaluation.scaling import evaluate_autoscalers

    if args.num_envs < 1:
        raise _CLIError("--num-envs must be >= 1")
    overrides = parse_pairs(args.overrides, "--set")
    learned = [load_run(Path(d)) for d in args.runs]
    # The learned runs act in their training action mode; every baseline acts by target
    # (`action_for_target`), so all share one environment built like the first run's.
    if learned:
        # Training-only settings (decision cadence, episode length, random phase of the day)
        # are not the evaluation scenario: the baselines run at the registry's cadence and a
        # policy trained at k times it decides every k-th interval (`hold_every`).
        base = {k: v for k, v in learned[0][1].env_overrides.items() if k not in TRAINING_ONLY}
        for k in ("workload", "load", "trace", "arrivals", "arrival_rate", "tokens"):
            if k in overrides:
                base.pop(k, None)
        overrides = {**base, **overrides}
    env, params = jaxserve.make("Autoscaling-v0", **overrides)
    dt = float(params.control_interval_s)
    for label, res in learned:
        if res.env.num_actions != env.num_actions:
            raise _CLIError(f"run {label} was trained with another action space")
    key = jax.random.key(args.seed)
    pols = {f"fixed-{n}": P.get("fixed", env=env, params=params, replicas=n)
            for n in range(1, env.max_replicas + 1)}
    for n in ("hpa", "knative", "ray_serve"):
        pols[n] = P.get(n, env=env, params=params)
    sched_c, sched_tuning = tune_scheduled(env, params, key, args)
    pols["scheduled"] = P.get("scheduled", env=env, params=params, replicas_at_mean=sched_c)
    pols["ray_serve(target=B)"] = P.get("ray_serve", env=env, params=params,
                                        target_ongoing_requests=None)
    for label, res in learned:
        k = float(res.env_params.control_interval_s) / dt
        if abs(k - round(k)) > 1e-6 or round(k) < 1:
            raise _CLIError(f"run {label} decided every {k * dt:g} s, not a multiple of {dt:g} s")
        pol = P.autoscaling.in_action_mode(res.policy, int(res.env_params.action_mode))
        pols[label] = P.autoscaling.hold_every(pol, round(k))
    t0 = time.perf_counter()
    results, per_env = evaluate_autoscalers(env, params, pols, key, args.num_envs,
                                            args.num_steps, episodes=True)
    wall = time.perf_counter() - t0
    ver = verdicts(results)
    paired = paired_comparisons(per_env, [label for label, _ in learned] + ["scheduled"])
    print_paired(paired)
    print_table(results, ver, f"Autoscaling-v0 {overrides or ''}: {args.num_envs} episodes of "
                f"{next(iter(results.values()))['intervals']:.0f} intervals ({wall:.0f} s)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "autoscale.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["policy", *COLUMNS])
            for n, r in results.items():
                w.writerow([n, *[r[k] for k in COLUMNS]])
        doc = {"command": "jaxserve-autoscale " + " ".join(sys.argv[1:]),
               "overrides": overrides, "num_envs": args.num_envs, "wall_s": wall,
               "results": results, "verdicts": ver, "paired": paired,
               "scheduled_tuning": sched_tuning}
        (out / "autoscale.json").write_text(json.dumps(to_jsonable(doc), indent=1))
        if not args.no_plot:
            plot(results, out / "cost_latency.png", f"Autoscaling-v0 {overrides or ''}")
        print(f"wrote {out}/ (autoscale.csv, autoscale.json"
              + ("" if args.no_plot else ", cost_latency.png") + ")")
    return 0


def print_table(results: dict, ver: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in ("policy", "cost (req-s)", "replica-hours", "replicas", "mean latency (s)",
                "SLO violated", "drops", "< every fixed", "< HPA", "below frontier"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    yes = {True: "yes", False: "no", None: "-"}
    for n, r in sorted(results.items(), key=lambda kv: kv[1]["cost"]):
        v = ver.get(n, {})
        t.add_row(n, f"{r['cost']:,.0f}", f"{r['gpu_hours']:.2f}", f"{r['mean_replicas']:.2f}",
                  f"{r['mean_latency']:.1f}", f"{100 * r['slo_violation_rate']:.1f}%",
                  f"{100 * r['drop_rate']:.2f}%", yes[v.get("cheaper_than_every_fixed")],
                  yes[v.get("cheaper_than_hpa")], yes[v.get("below_fixed_frontier")])
    Console(width=max(Console().width, 140)).print(t)


def main(argv: list[str] | None = None) -> int:
    """Console entry point (`jaxserve-autoscale`); returns the exit status."""
    return run_cli("jaxserve-autoscale", lambda: run(build_parser().parse_args(argv)))

if __name__ == "__main__":
    sys.exit(main())
