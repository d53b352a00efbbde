"""jaxserve-pareto: speed versus GPU-hours of the inference replicas serving RL rollouts.

Example::

    python -m jaxserve.scripts.pareto --requests 256 --train-s 0,60,300 --max-replicas 8 \
        --profile mid --iterations 16 --max-batch 16,32 --out runs/pareto

Each RL iteration submits K rollouts at once to r identical replicas (static batcher), waits for
the last one, then trains for train_s seconds (`jaxserve.workloads.rollout`, docs/scaling.md).
Replica counts 1..R x routing rules x max_batch values x iterations (seeds) run as ONE jitted
program, paired over the same request draws. Prints, for each train_s, a table (iteration time,
speedup over r = 1 of the same setting, GPU-hours per iteration, marginal speedup per extra
GPU-hour) and the Pareto frontier of (speedup over the reference setting's r = 1: up,
GPU-hours per iteration: down); writes `pareto.csv`, `pareto.json` and `pareto.png` to --out
(checked before any work: a file, or a folder holding other files unless `--overwrite`, is
refused).

Continuous-batching replicas (vLLM-style iteration-level scheduling with a paged KV cache,
`jaxserve.core.continuous`): `--replica opt13b-a100-80g` (a named `ReplicaProfile`) replaces
`--profile`; `--max-batch` then sweeps `max_seqs` and `lpt_batch` is not a rule::

    python -m jaxserve.scripts.pareto --replica opt13b-a100-80g --requests 256 --train-s 60 \
        --max-replicas 8 --max-batch 32,64 --out runs/pareto_continuous

Errors print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from jaxserve.core import arrivals as A
from jaxserve.core.replica import NAMED_REPLICAS
from jaxserve.evaluation.serialize import to_jsonable
from jaxserve.traces import load, path as trace_path
from jaxserve.workloads import pareto_front
from jaxserve.workloads import rollout as W
from jaxserve.scripts.cli import CLIError as _CLIError
from jaxserve.scripts.cli import Parser as _Parser
from jaxserve.scripts.cli import output_dir, run_cli

TRACE_NAMES = {  # --tokens value -> `jaxserve.traces.registry` name
    "azure_conv": "azure_llm_2023_conv",
    "azure_code": "azure_llm_2023_code",
}
# A setting's marginal speedup per extra GPU-hour has "collapsed" once it falls below this
# fraction of its first extra replica's (r = 1 -> 2).
COLLAPSE = 0.25




def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="jaxserve-pareto", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", "-K", type=int, default=256, help="rollouts per iteration (K)")
    ap.add_argument("--train-s", default="60",
                    help="training seconds per iteration; comma-separated for several")
    ap.add_argument("--max-replicas", type=int, default=8, help="sweep r = 1..this")
    ap.add_argument("--profile", default="mid", help="GPU profile name (e.g. mid, fast, slow)")
    ap.add_argument("--replica", default=None,
                    help="continuous-batching replica profile name (e.g. opt13b-a100-80g); "
                         "replaces --profile, and --max-batch sweeps max_seqs")
    ap.add_argument("--tokens", default="lognormal",
                    help="lognormal, azure_conv, azure_code (real trace lengths of the public "
                         "Azure LLM 2023 traces: `jaxserve-traces fetch azure_llm_2023_conv`) "
                         "or a trace file path")
    ap.add_argument("--prompt-median", type=float, default=512.0)
    ap.add_argument("--prompt-sigma", type=float, default=0.5)
    ap.add_argument("--output-median", type=float, default=1024.0)
    ap.add_argument("--output-sigma", type=float, default=1.0,
                    help="lognormal sigma of output lengths (the tail)")
    ap.add_argument("--max-prompt", type=float, default=8192.0)
    ap.add_argument("--max-output", type=float, default=16384.0, help="generation cap (tokens)")
    ap.add_argument("--estimate", default="noisy", choices=("exact", "noisy", "class"),
                    help="what routing knows of output lengths")
    ap.add_argument("--estimate-noise", type=float, default=0.5,
                    help="lognormal sigma of noisy estimates")
    ap.add_argument("--iterations", type=int, default=16, help="iterations (seeds) per point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rules", default="all", help="comma-separated routing rules, or all")
    ap.add_argument("--max-batch", default=None,
                    help="comma-separated max_batch values (max_seqs with --replica; default: "
                         "the profile's)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="batching timeout (s) (default: the profile's)")
    ap.add_argument("--trainer-gpus", type=float, default=0.0,
                    help="trainer GPUs, for the separately reported trainer GPU-hours")
    ap.add_argument("--gpus-per-replica", type=float, default=1.0,
                    help="GPUs per replica (GPU-hours are r * this * T / 3600)")
    ap.add_argument("--out", default="runs/pareto", help="output directory")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into a non-empty --out that holds other files")
    ap.add_argument("--no-plot", action="store_true")
    return ap


def _list(text: str, cast, what: str) -> list:
    try:
        vals = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _CLIError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not vals:
        raise _CLIError(f"{what} is empty")
    return vals


def _tokens(args):
    if args.tokens == "lognormal":
        return A.lognormal_tokens(args.prompt_median, args.prompt_sigma, args.output_median,
                                  args.output_sigma, args.max_prompt, args.max_output), \
            (f"lognormal prompt (median {args.prompt_median:g}, sigma {args.prompt_sigma:g}) and "
             f"output (median {args.output_median:g}, sigma {args.output_sigma:g}, cap "
             f"{args.max_output:g}) tokens")
    if args.tokens in TRACE_NAMES:
        path = trace_path(TRACE_NAMES[args.tokens])  # names `jaxserve-traces fetch` if missing
    else:
        path = Path(args.tokens)
        if not path.is_file():
            raise _CLIError(f"trace file not found: {path} (--tokens takes lognormal, "
                            f"{', '.join(TRACE_NAMES)} or a trace file)")
    tr = load(path)
    return A.empirical_tokens(tr.prompt_tokens, tr.output_tokens), \
        f"empirical (prompt, output) rows of {path.name} ({len(tr)} requests)"


def _fmt(v, fmt="{:.3f}"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return fmt.format(v)


def _mark(rows: list[dict]) -> None:
    """Adds `on_frontier`, `collapsed` and `frontier_marginal` to rows (per train_s)."""
    for ts in sorted({r["train_s"] for r in rows}):
        sub = [r for r in rows if r["train_s"] == ts]
        front = pareto_front([r["speedup_vs_ref"] for r in sub], [r["gpu_hours"] for r in sub])
        for r in sub:
            r["on_frontier"] = False
            r["frontier_marginal"] = float("nan")
        prev = None
        for i in front:
            r = sub[i]
            r["on_frontier"] = True
            if prev is not None:
                dh = r["gpu_hours"] - prev["gpu_hours"]
                ds = r["speedup_vs_ref"] - prev["speedup_vs_ref"]
                r["frontier_marginal"] = (ds / dh if dh > 0 else
                                          float("inf") if ds > 0 else float("nan"))
            prev = r
        first = {}
        for r in sub:
            key = (r["max_batch"], r["rule"])
            if r["replicas"] == 2:
                first[key] = r["marginal_speedup_per_gpu_hour"]
        for r in sub:
            m0 = first.get((r["max_batch"], r["rule"]), float("nan"))
            m = r["marginal_speedup_per_gpu_hour"]
            r["collapsed"] = bool(r["replicas"] > 2 and np.isfinite(m0) and m0 > 0
                                  and m < COLLAPSE * m0)


def _print_tables(rows: list[dict], console, title: str) -> None:
    for ts in sorted({r["train_s"] for r in rows}):
        sub = [r for r in rows if r["train_s"] == ts]
        t = Table(title=f"{title}, train_s = {ts:g} s  (* Pareto frontier; marginal in red: "
                        f"below {COLLAPSE:g} x the setting's first extra replica's)")
        trainer = any(r["trainer_gpu_hours"] > 0 for r in sub)
        cols = ["max_batch", "rule", "r", "iteration (s)", "makespan", "speedup", "vs ref",
                "eff.", "GPU-h/iter", "marginal dS/dGPU-h", "p99 lat", "util", ""]
        if trainer:
            cols.insert(9, "+trainer GPU-h")
        for col in cols:
            t.add_column(col, justify="left" if col in ("rule", "") else "right")
        prev_setting = None
        for r in sub:
            setting = (r["max_batch"], r["rule"])
            if prev_setting is not None and setting != prev_setting:
                t.add_section()
            prev_setting = setting
            marg = _fmt(r["marginal_speedup_per_gpu_hour"], "{:.2f}")
            if r["collapsed"]:
                marg = f"[red]{marg}[/red]"
            cells = [str(r["max_batch"]), r["rule"], str(r["replicas"]),
                     f"{r['iteration_s']:.1f} ± {_fmt(r['iteration_ci95'], '{:.1f}')}",
                     f"{r['makespan_s']:.1f}",
                     f"{r['speedup']:.3f} ± {_fmt(r['speedup_ci95'])}",
                     f"{r['speedup_vs_ref']:.3f}", f"{r['efficiency']:.2f}",
                     f"{r['gpu_hours']:.4f}", marg, f"{r['p99_latency_s']:.1f}",
                     f"{r['utilisation']:.2f}", "*" if r["on_frontier"] else ""]
            if trainer:
                cells.insert(9, f"{r['trainer_gpu_hours']:.4f}")
            t.add_row(*cells)
        console.print(t)
        f = Table(title=f"Pareto frontier, train_s = {ts:g} s: speedup over the reference's "
                        f"r = 1 (up) vs GPU-hours per iteration (down)")
        for col in ("max_batch", "rule", "r", "speedup vs ref", "GPU-h/iter",
                    "dS/dGPU-h along frontier"):
            f.add_column(col, justify="left" if col == "rule" else "right")
        for r in sorted((r for r in sub if r["on_frontier"]), key=lambda r: r["gpu_hours"]):
            f.add_row(str(r["max_batch"]), r["rule"], str(r["replicas"]),
                      f"{r['speedup_vs_ref']:.3f}", f"{r['gpu_hours']:.4f}",
                      _fmt(r["frontier_marginal"], "{:.2f}"))
        console.print(f)


def _plot(rows: list[dict], path: Path, title: str, reference: tuple[str, int]) -> None:
    ts_values = sorted({r["train_s"] for r in rows})
    settings = sorted({(r["max_batch"], r["rule"]) for r in rows},
                      key=lambda s: (s[0], s[1]))
    fig = Figure(figsize=(12, 4.3 * len(ts_values)))
    axes = fig.subplots(len(ts_values), 2, squeeze=False)
    rule_names = sorted({s[1] for s in settings})
    cmap = {s: f"C{rule_names.index(s[1]) % 10}" for s in settings}  # colour: rule
    styles = {mb: ls for mb, ls in  # line style: max_batch
              zip(sorted({s[0] for s in settings}), ("-", "--", "-.", ":", "-", "--"))}
    for row_ax, ts in zip(axes, ts_values):
        ax_r, ax_h = row_ax
        sub = [r for r in rows if r["train_s"] == ts]
        rmax = max(r["replicas"] for r in sub)
        for s in settings:
            pts = sorted((r for r in sub if (r["max_batch"], r["rule"]) == s),
                         key=lambda r: r["replicas"])
            lab = f"{s[1]}, B={s[0]}"
            ax_r.plot([p["replicas"] for p in pts], [p["speedup_vs_ref"] for p in pts],
                      marker="o", ms=3, lw=1.2, color=cmap[s], ls=styles[s[0]], label=lab)
            ax_h.plot([p["gpu_hours"] for p in pts], [p["speedup_vs_ref"] for p in pts],
                      marker="o", ms=3, lw=1.0, color=cmap[s], ls=styles[s[0]], alpha=0.8)
        ref1 = next(r for r in sub if r["rule"] == reference[0]
                    and r["max_batch"] == reference[1] and r["replicas"] == 1)
        ax_r.plot([1, rmax], [1, rmax], color="0.5", ls=":", lw=1, label="ideal linear speedup")
        ax_r.set_xlabel("inference replicas r")
        ax_r.set_ylabel(f"speedup over r=1 of {reference[0]}, B={reference[1]}")
        ax_r.set_title(f"train_s = {ts:g} s")
        ax_r.grid(alpha=0.3)
        front = sorted((r for r in sub if r["on_frontier"]), key=lambda r: r["gpu_hours"])
        ax_h.plot([r["gpu_hours"] for r in front], [r["speedup_vs_ref"] for r in front],
                  color="k", lw=2.4, alpha=0.35, zorder=0, label="Pareto frontier")
        ax_h.scatter([r["gpu_hours"] for r in front], [r["speedup_vs_ref"] for r in front],
                     s=70, facecolors="none", edgecolors="k", lw=1.2, zorder=3)
        for r in front:
            ax_h.annotate(f"r={r['replicas']}", (r["gpu_hours"], r["speedup_vs_ref"]),
                          textcoords="offset points", xytext=(5, -10), fontsize=7)
        ax_h.axvline(ref1["gpu_hours"], color="0.5", ls=":", lw=1,
                     label="ideal linear speedup (GPU-h stay at r=1's)")
        ax_h.set_xlabel("inference GPU-hours per iteration")
        ax_h.set_ylabel("speedup (same reference)")
        ax_h.set_title(f"speed vs GPU-hours, train_s = {ts:g} s (circles: frontier)")
        ax_h.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right", title="colour: rule, line: max_batch B",
                      title_fontsize=7)
    axes[0][1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")


CSV_FIELDS = ("train_s", "max_batch", "rule", "replicas", "iteration_s", "iteration_ci95",
              "makespan_s", "speedup", "speedup_ci95", "speedup_vs_ref", "efficiency",
              "gpu_hours", "trainer_gpu_hours", "total_gpu_hours",
              "marginal_speedup_per_gpu_hour", "collapsed", "on_frontier", "frontier_marginal",
              "mean_latency_s", "p50_latency_s", "p99_latency_s", "max_latency_s", "batches",
              "utilisation", "dropped")


# What `run` writes into --out (a folder holding only these is an earlier run: replaced).
OUTPUTS = ("pareto.csv", "pareto.json", "pareto.png")


def run(args) -> int:


    t_start = time.perf_counter()
    out = output_dir(args.out, "--out", OUTPUTS, overwrite=args.overwrite)
    train_s = _list(args.train_s, float, "--train-s")
    if any(not math.isfinite(t) or t < 0 for t in train_s):
        raise _CLIError(f"--train-s must be non-negative numbers, got {args.train_s!r}")
    for name in ("requests", "max_replicas", "iterations"):
        if getattr(args, name) < 1:
            raise _CLIError(f"--{name.replace('_', '-')} must be >= 1")
    continuous = args.replica is not None
    if continuous:
        if args.replica not in NAMED_REPLICAS:
            raise _CLIError(f"unknown --replica {args.replica!r}; known: "
                            f"{', '.join(sorted(NAMED_REPLICAS))}")
        if args.timeout is not None:
            raise _CLIError("--timeout is a static-batching setting; continuous replicas have "
                            "none")
    all_rules = W.CONTINUOUS_RULES if continuous else W.RULES
    rules = list(all_rules) if args.rules.strip() == "all" else \
        [x.strip() for x in args.rules.split(",") if x.strip()]
    if not rules:
        raise _CLIError("--rules names no rule")
    for r in rules:
        if r not in all_rules:
            raise _CLIError(f"unknown routing rule {r!r}; valid: {', '.join(all_rules)}")
    overrides = {} if args.timeout is None else {"timeout": args.timeout}
    tokens, tokens_desc = _tokens(args)
    params = W.make_params(args.requests, gpu=args.replica if continuous else args.profile,
                           tokens=tokens,
                           estimate_mode=args.estimate, estimate_noise=args.estimate_noise,
                           train_s=train_s[0], trainer_gpus=args.trainer_gpus,
                           gpus_per_replica=args.gpus_per_replica, **overrides)
    batch_field = "max_seqs" if continuous else "max_batch"
    mbs = ([int(np.asarray(getattr(params.gpu, batch_field)))] if args.max_batch is None
           else _list(args.max_batch, int, "--max-batch"))
    console = Console(width=max(Console().width, 200))
    n_sims = len(mbs) * len(rules) * args.max_replicas * args.iterations
    with console.status(f"simulating {n_sims} iterations ({len(mbs)} max_batch x {len(rules)} "
                        f"rules x {args.max_replicas} replica counts x {args.iterations} seeds, "
                        f"K={args.requests}) in one jitted program..."):
        raw = W.sweep_raw(jax.random.PRNGKey(args.seed), params, num_requests=args.requests,
                          max_replicas=args.max_replicas, rules=rules, max_batches=mbs,
                          iterations=args.iterations)
    reference = ("round_robin" if "round_robin" in rules else rules[0], mbs[0])
    rows = W.tabulate(raw, train_s=train_s, gpus_per_replica=args.gpus_per_replica,
                      trainer_gpus=args.trainer_gpus, reference=reference)
    _mark(rows)
    served = (f"continuous-batching {args.replica} replicas (max_batch column = max_seqs)"
              if continuous else f"{args.profile} replicas")
    title = (f"{args.requests} rollouts/iteration on {served}, {tokens_desc}; "
             f"estimates {args.estimate}; {args.iterations} iterations (paired)")
    _print_tables(rows, console, title)
    console.print(f"simulated {n_sims} iterations in {raw['seconds']:.1f} s (compile + run); "
                  f"reference for 'vs ref' and the frontier: {reference[0]}, max_batch "
                  f"{reference[1]}, r = 1")

    with open(out / "pareto.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in rows:
            w.writerow([r[k] for k in CSV_FIELDS])
    argv = sys.argv[1:] if args.argv is None else args.argv
    doc = {
        "command": "python -m jaxserve.scripts.pareto " + " ".join(argv),
        "config": {k: v for k, v in vars(args).items() if k != "argv"},
        "tokens": tokens_desc, "reference": {"rule": reference[0], "max_batch": reference[1]},
        "profile": {f: np.asarray(getattr(params.gpu, f)).item()
                    for f in params.gpu.__dataclass_fields__ if f != "name"}
        | {"name": params.gpu.name, "continuous": continuous},
        "rows": rows,
        "frontier": [r for r in rows if r["on_frontier"]],
        "sweep_seconds": raw["seconds"],
        "wall_seconds": time.perf_counter() - t_start,
    }
    with open(out / "pareto.json", "w") as f:
        json.dump(to_jsonable(doc), f, indent=1)
    written = ["pareto.csv", "pareto.json"]
    if not args.no_plot:
        _plot(rows, out / "pareto.png", title, reference)
        written.append("pareto.png")
    console.print(f"wrote {', '.join(str(out / w) for w in written)} "
                  f"({time.perf_counter() - t_start:.1f} s in all)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point (`jaxserve-pareto`); returns the exit status."""
    def body():
        args = build_parser().parse_args(argv)
        args.argv = argv
        return run(args)
    return run_cli("jaxserve-pareto", body)

if __name__ == "__main__":
    sys.exit(main())
