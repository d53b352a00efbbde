"""jaxserve-eval: evaluate baseline policies on a jaxserve environment, on common random numbers.

Example::

    jaxserve-eval --env Routing-v0 --policies jsq,sed,sita --num-envs 16 --num-steps 2000 \
        --out results/routing

Prints a table with 95% CIs and a table of paired differences against `--reference` (the
Student-t CI over per-environment differences on the common streams: the comparison to
read), writes `results.csv`, `results.json` and, unless `--no-plots`,
`latency_cdf.png`, `load_sweep.png` (p99 latency and goodput vs arrival rate) and, for
routing, `class_mix.png`. `--out` is checked before any work: a file, or a folder holding files
other than these (unless `--overwrite`), is refused. Errors (unknown environment or policy,
missing or malformed trace, impossible SLO, bad arguments) print one line on stderr and exit
with status 2.
"""

from __future__ import annotations

import argparse
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
from jaxserve import policies as P
from jaxserve.core import arrivals as A
from jaxserve.core.sources import split_trace, tuning_key
from jaxserve.envs.base import policy_kind
from jaxserve.evaluation import plots
from jaxserve.evaluation.capacity import capacity, check_slo, sweep_rates
from jaxserve.evaluation.evaluate import paired_table
from jaxserve.evaluation.serialize import to_jsonable
from jaxserve.traces import load
from jaxserve.scripts.cli import CLIError as _CLIError
from jaxserve.scripts.cli import Parser as _Parser
from jaxserve.scripts.cli import output_dir, run_cli


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="jaxserve-eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="Routing-v0", help="environment id (Routing-v0, Batching-v0)")
    ap.add_argument("--policies", default=None,
                    help="comma-separated policy names (default: every policy for the env)")
    ap.add_argument("--num-envs", type=int, default=16, help="independent replicates")
    ap.add_argument("--num-steps", type=int, default=1000, help="requests per environment")
    ap.add_argument("--warmup", type=int, default=0, help="requests excluded at the start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=None, help="override the Poisson arrival rate")
    ap.add_argument("--trace", default=None, help="replay this trace file instead of sampling")
    ap.add_argument("--loads", default="0.5,0.75,1.0,1.25",
                    help="load sweep: multiples of the arrival rate ('' to skip)")
    ap.add_argument("--sweep-envs", type=int, default=4)
    ap.add_argument("--sweep-steps", type=int, default=500)
    ap.add_argument("--reference", default=None,
                    help="policy the paired differences are taken against (default: jsq for "
                         "routing, greedy for batching, else the first policy)")
    ap.add_argument("--fit-fraction", type=float, default=0.25,
                    help="with --trace: fit SITA/tuned_static/smdp_optimal on this leading "
                         "fraction of the trace and score every policy on the rest")
    ap.add_argument("--slo-p99", type=float, default=None,
                    help="also find each policy's capacity: highest rate with p99 <= this (s)")
    ap.add_argument("--out", default="results/eval", help="output directory")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into a non-empty --out that holds other files")
    ap.add_argument("--no-plots", action="store_true")
    return ap


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _CLIError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if any(not np.isfinite(v) or v <= 0 for v in vals):
        raise _CLIError(f"{what} must be positive numbers, got {text!r}")
    return vals


SCALARS = ("mean_latency", "mean_latency_ci95", "mean_latency_incl_drops",
           "mean_latency_incl_drops_ci95", "p50_latency", "p90_latency", "p99_latency",
           "p99_latency_ci95", "max_latency", "throughput", "throughput_ci95", "goodput",
           "goodput_ci95", "slo_attainment", "cost_per_request", "cost_ci95", "dropped",
           "drop_rate", "gpu_seconds", "sim_seconds", "arrived", "completed", "in_flight",
           "invalid_actions", "decisions")


def _print_table(results: dict, title: str) -> None:

    def ci(v, h, fmt="{:.3f}"):
        return fmt.format(v) + ("" if not np.isfinite(h) else " ± " + fmt.format(h))

    t = Table(title=title)
    for col in ("policy", "mean lat (s)", "incl. drops (s)", "p50", "p90", "p99 (s)", "max", "throughput",
                "goodput", "drops", "util per GPU"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for name, r in results.items():
        t.add_row(name, ci(r["mean_latency"], r["mean_latency_ci95"]),
                  ci(r["mean_latency_incl_drops"], r["mean_latency_incl_drops_ci95"]),
                  f"{r['p50_latency']:.3f}", f"{r['p90_latency']:.3f}",
                  ci(r["p99_latency"], r["p99_latency_ci95"]), f"{r['max_latency']:.2f}",
                  ci(r["throughput"], r["throughput_ci95"], "{:.2f}"),
                  ci(r["goodput"], r["goodput_ci95"], "{:.2f}"), str(r["dropped"]),
                  " ".join(f"{u:.2f}" for u in r["utilisation"]))
    Console(width=max(Console().width, 160)).print(t)
    print("mean lat: served requests only (drops excluded); incl. drops: every request, a "
          "dropped one at drop_penalty_s")


def _print_paired(paired: dict, reference: str, title: str) -> None:

    t = Table(title=title)
    for col in ("policy", "Δ lat incl. drops (s)", "Δ mean lat (s)", "Δ goodput (req/s)"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for name, row in paired.items():
        t.add_row(name, *[f"{d['mean']:+.3f} ± {d['ci']:.3f}" + (" *" if d["significant"] else "")
                          for d in (row["mean_latency_incl_drops"], row["mean_latency"],
                                    row["goodput"])])
    Console(width=max(Console().width, 120)).print(t)
    print(f"paired differences (policy - {reference}) on common streams, 95% Student-t CI "
          f"over environments; * = the interval excludes 0")


# What `run` writes into --out (a folder holding only these is an earlier run: replaced).
OUTPUTS = ("results.csv", "results.json", "load_sweep.csv", "latency_cdf.png",
           "load_sweep.png", "class_mix.png")


def run(args) -> int:


    out = output_dir(args.out, "--out", OUTPUTS, overwrite=args.overwrite)
    if args.num_envs < 1 or args.num_steps < 1:
        raise _CLIError("--num-envs and --num-steps must be >= 1")
    if args.env not in jaxserve.registered_envs():
        raise _CLIError(f"unknown environment {args.env!r}; registered: "
                        f"{', '.join(jaxserve.registered_envs())}")
    overrides = {} if args.rate is None else {"arrival_rate": args.rate}
    env, params = jaxserve.make(args.env, **overrides)
    kind = policy_kind(env)
    names = (list(P.names(kind)) if args.policies is None
             else [n.strip() for n in args.policies.split(",") if n.strip()])
    if not names:
        raise _CLIError("--policies names no policy")
    for n in names:
        if n not in P.names():
            raise _CLIError(f"unknown policy {n!r}; for {args.env}: {', '.join(P.names(kind))}")
        if kind not in P.kinds_of(n):
            held = " or ".join(P.kinds_of(n))
            raise _CLIError(f"policy {n!r} is a {held} policy; {args.env} needs one of: "
                            f"{', '.join(P.names(kind))}")
    loads = _floats(args.loads, "--loads") if args.loads.strip() else []
    if args.slo_p99 is not None:
        check_slo(params, args.slo_p99)

    trace = None
    fit_params = params
    fit_window = None
    if args.trace is not None:
        path = Path(args.trace)
        if not path.is_file():
            raise _CLIError(f"trace file not found: {args.trace}")
        trace = load(path)
        if len(trace) < 2:
            raise _CLIError(f"trace {args.trace} has fewer than 2 requests")
        # Fit on a leading window, score on the disjoint rest: never fit on scored requests.
        try:
            fit_trace, trace = split_trace(trace, args.fit_fraction)
        except ValueError as e:
            raise _CLIError(str(e)) from None
        fit_window = [0, len(fit_trace)]
        span = float(fit_trace.arrival_s[-1] - fit_trace.arrival_s[0])
        rate = (len(fit_trace) - 1) / span if span > 0 else float(len(fit_trace))
        fit_params = params.replace(arrivals=A.poisson(rate), tokens=A.empirical_tokens(
            fit_trace.prompt_tokens, fit_trace.output_tokens))

    key = jax.random.PRNGKey(args.seed)
    t0 = time.time()
    # Fitted and tuned policies get the tuning key: streams disjoint from the evaluation's.
    tkey = tuning_key(key)
    pols = {n: P.get(n, kind=kind, env=env, params=fit_params,
                     **({"key": tkey} if "key" in P.options(n, kind) else {})) for n in names}
    results = jaxserve.evaluate_many(env, params, pols, key, args.num_envs, args.num_steps,
                                     warmup=args.warmup, trace=trace)
    src = (f"trace {args.trace} (scored window: requests {fit_window[1]}+; fitted on "
           f"0..{fit_window[1] - 1})" if trace is not None
           else f"{args.num_envs} envs x {args.num_steps} requests")
    _print_table(results, f"{args.env}: {src}, seed {args.seed} (95% CIs over environments)")
    reference = args.reference or next(
        (r for r in ({"routing": "jsq", "batching": "greedy"}.get(kind),) if r in results),
        names[0])
    if reference not in results:
        raise _CLIError(f"--reference {reference!r} is not among the evaluated policies")
    paired = paired_table(results, reference) if len(results) > 1 else {}
    if paired:
        _print_paired(paired, reference, f"{args.env}: paired differences against {reference}")

    sweep, caps = {}, {}
    base_rate = float(np.asarray(A.mean_rate(params.arrivals)))
    if loads and trace is None:
        sweep = sweep_rates(env, params, pols, [base_rate * f for f in loads],
                            jax.random.fold_in(key, 1), args.sweep_envs, args.sweep_steps,
                            warmup=min(args.warmup, args.sweep_steps - 1))
    if args.slo_p99 is not None:
        if trace is not None:
            raise _CLIError("--slo-p99 needs synthetic arrivals (it varies the arrival rate)")
        for n, pol in pols.items():
            caps[n] = capacity(env, params, pol, args.slo_p99, jax.random.fold_in(key, 2),
                               args.sweep_envs, args.sweep_steps)
            print(f"capacity {n}: {caps[n]['rate']:.3f} req/s with p99 <= {args.slo_p99:g} s")

    num_gpus = len(next(iter(results.values()))["utilisation"])
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", *SCALARS, *[f"util_gpu{g}" for g in range(num_gpus)]])
        for n, r in results.items():
            w.writerow([n, *[r[k] for k in SCALARS], *[f"{u:.6f}" for u in r["utilisation"]]])
    if sweep:
        with open(out / "load_sweep.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["policy", "rate", "p99_with_drops", "p99_latency", "mean_latency",
                        "goodput", "throughput", "drop_rate"])
            for n, rows in sweep.items():
                for r in rows:
                    w.writerow([n, r["rate"], r["p99_with_drops"], r["p99_latency"],
                                r["mean_latency"], r["goodput"], r["throughput"], r["drop_rate"]])
    info = {n: {k: v for k, v in pols[n].info.items() if k in ("max_batch", "timeout", "table",
                                                             "gain", "mean_latency", "rate",
                                                             "note", "fallback")}
            for n in pols if hasattr(pols[n], "info")}
    doc = {
        "command": "jaxserve-eval " + " ".join(sys.argv[1:]) if args.argv is None
        else "jaxserve-eval " + " ".join(args.argv),
        "env": args.env, "seed": args.seed, "num_envs": args.num_envs,
        "num_steps": args.num_steps, "warmup": args.warmup, "trace": args.trace,
        "arrival_rate": base_rate if trace is None else None,
        "fit_window": fit_window,
        "results": {n: {k: v for k, v in r.items() if k != "latencies"}
                    for n, r in results.items()},
        "paired_reference": reference,
        "paired": paired,
        "policy_info": info,
        "load_sweep": {n: [{k: r[k] for k in ("rate", "p99_with_drops", "p99_latency",
                                              "mean_latency", "goodput", "throughput",
                                              "drop_rate")} for r in rows]
                       for n, rows in sweep.items()},
        "capacity": caps,
        "wall_seconds": time.time() - t0,
    }
    with open(out / "results.json", "w") as f:
        json.dump(to_jsonable(doc), f, indent=1)
    if not args.no_plots:
        plots.latency_cdf(results, out / "latency_cdf.png", f"{args.env}: latency CDF")
        if sweep:
            plots.load_sweep(sweep, out / "load_sweep.png", f"{args.env}: load sweep")
        if kind == "routing":
            edges = np.asarray(params.size_edges)
            labels = ([f"output <= {edges[0]:g}"]
                      + [f"({a:g}, {b:g}]" for a, b in zip(edges[:-1], edges[1:])]
                      + [f"output > {edges[-1]:g}"])
            plots.class_mix(results, out / "class_mix.png", labels,
                            f"{args.env}: size classes each GPU received")
    print(f"wrote {out}/results.csv, results.json" + ("" if args.no_plots else " and plots"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point (`jaxserve-eval`); returns the exit status."""
    def body():
        args = build_parser().parse_args(argv)
        args.argv = argv
        return run(args)
    return run_cli("jaxserve-eval", body)

if __name__ == "__main__":
    sys.exit(main())
