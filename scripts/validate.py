"""jaxserve-validate: replay real vLLM runs through the engine and report how close it is.

Example::

    jaxserve-validate ../shared/fidelity/llmservingsim_vllm_bench/runs/RTX4090__Llama-3.1-8B \
        --out results/fidelity

For each run folder (the `llmservingsim_vllm_bench` format: `vllm_meta.json`,
`vllm_requests.jsonl`, optional `vllm_timeseries.csv` and `llmservingsim_*` files, the workload
beside it or in `../../workloads/`), derives the replica's iteration times from the kernel
profiles of the same GPU and model (`--profiles`, default `profiles/` beside `runs/`), replays
the exact workload through the JAX engine with prefix caching and chunked prefill, prints the
error table (real vs jaxserve vs LLMServingSim: mean, p50, p90, p99 of TTFT, TPOT and E2E) and
writes `OUT/<run>/`: `per_request.csv`, `summary.json`, `table.md`, `cdf.png`,
`timeseries.png`. Nothing is fitted to the run's latencies (docs/fidelity.md).
Errors print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from jaxserve.evaluation.fidelity import (FidelityOptions, table_markdown, validate_run,
                                          write_report)
from jaxserve.evaluation.fidelity_blis import blis_markdown, blis_rows, fidelity_dir
from jaxserve.evaluation.fidelity_report import measure_bench, render_doc
from jaxserve.scripts.cli import CLIError, Parser, run_cli


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="jaxserve-validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="run folders (llmservingsim_vllm_bench format)")
    ap.add_argument("--doc", default=None,
                    help="instead of RUNS: validate every run of --bench-root, measure what "
                         "each left-out mechanism costs and the BLIS set, and write this "
                         "Markdown page (figures beside it in figures/fidelity/)")
    ap.add_argument("--bench-root", default=None,
                    help="with --doc: the llmservingsim_vllm_bench folder (default: "
                         "$JAXSERVE_FIDELITY_DIR/llmservingsim_vllm_bench, else "
                         "../shared/fidelity/... beside the repository)")
    ap.add_argument("--overhead-run", default="RTXPRO6000__Llama-3.1-8B",
                    help="with --doc: the run a per-iteration host overhead is fitted on "
                         "('' for none)")
    ap.add_argument("--profiles", default=None,
                    help="kernel-profile directory (.../<org>/<model>/bf16) or a root holding "
                         "<GPU>/<org>/<model>/bf16 (default: profiles/ beside runs/)")
    ap.add_argument("--out", default="results/fidelity", help="output folder")
    ap.add_argument("--arrivals", choices=("workload", "queued"), default="workload",
                    help="replay the workload's send times (default) or vLLM's queued times "
                         "(a diagnostic: takes the front end's delay from the run)")
    ap.add_argument("--step-overhead-ms", type=float, default=0.0,
                    help="host time added to every iteration (ms), e.g. one estimated on "
                         "another run; default 0")
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="KV blocks per engine (default: the run's record, else derived)")
    ap.add_argument("--layers", type=int, default=None,
                    help="the model's decoder layers, for a model jaxserve.core.kernel_fit."
                         "MODEL_SHAPES does not list")
    ap.add_argument("--reserve-full-prompt", action="store_true",
                    help="admission reserves the whole sequence's blocks (vLLM 0.19's "
                         "scheduler_reserve_full_isl); runs in the reference simulator only")
    return ap


def _check_out(path: str) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {path} is a file; give a folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _doc(args) -> int:
    root = Path(args.bench_root) if args.bench_root else fidelity_dir() / "llmservingsim_vllm_bench"
    doc = Path(args.doc)
    if doc.exists() and doc.is_dir():
        raise CLIError(f"--doc {args.doc} is a folder; give a file name")
    doc.parent.mkdir(parents=True, exist_ok=True)
    console = Console()
    with console.status("measuring") as status:
        measured = measure_bench(root, args.profiles, args.overhead_run or None,
                                 progress=lambda m: status.update(m))
        status.update("the BLIS set")
        blis = blis_markdown(blis_rows())
    cmd = "jaxserve-validate --doc " + args.doc
    text = render_doc(measured, doc.parent / "figures" / "fidelity", "figures/fidelity", blis,
                      cmd)
    doc.write_text(text)
    console.print(f"wrote {doc}")
    return 0


def run(args) -> int:
    if args.doc is not None:
        return _doc(args)
    if not args.runs:
        raise CLIError("give run folders, or --doc PATH")
    if args.step_overhead_ms < 0:
        raise CLIError("--step-overhead-ms must be >= 0")
    if args.kv_blocks is not None and args.kv_blocks < 1:
        raise CLIError("--kv-blocks must be >= 1")
    if args.layers is not None and args.layers < 1:
        raise CLIError("--layers must be >= 1")
    for r in args.runs:
        if not (Path(r) / "vllm_meta.json").is_file():
            raise CLIError(f"{r} is not a run folder (no vllm_meta.json)")
    out = _check_out(args.out)
    console = Console()
    opts = FidelityOptions(arrivals=args.arrivals, step_overhead_s=args.step_overhead_ms * 1e-3,
                           reserve_full_prompt=args.reserve_full_prompt,
                           kv_blocks=args.kv_blocks, layers=args.layers)
    for r in args.runs:
        with console.status(f"validating {Path(r).name}") as status:
            res = validate_run(r, args.profiles, opts,
                               progress=lambda m: status.update(m))
        paths = write_report(res, out / res.run)
        console.print(f"\n[bold]{res.run}[/bold]  ({res.seconds['total']:.0f} s; KV blocks "
                      f"{res.replica['kv_blocks']} from {res.kv_blocks_source}; step form fit "
                      f"rms {100 * res.fit['residuals']['rms']:.1f}% over "
                      f"{res.fit['residuals']['n']} batches)")
        if res.summary_check is not None:
            ok = "reproduced" if res.summary_check["reproduced"] else "NOT reproduced"
            console.print(f"real summary from the per-request file: {ok} (max diff "
                          f"{res.summary_check['max_abs_diff_ms']:.2f} ms at print precision)")
        console.print(f"engine vs reference, per request: max |diff| "
                      f"{res.engine_vs_reference_max_diff_s:.2e} s")
        print(table_markdown(res))  # plain: a Markdown table must not be wrapped
        console.print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point (`jaxserve-validate`); returns the exit status."""
    return run_cli("jaxserve-validate", lambda: run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
