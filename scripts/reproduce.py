"""Regenerates docs/results.md and docs/figures/results_*.png: every experiment, one command.

    python scripts/reproduce.py --quick        # 2-core CPU, under 20 minutes
    python scripts/reproduce.py                # full budgets, meant for a GPU
    python scripts/reproduce.py --quick --only b,c --out runs/results.md
    python scripts/reproduce.py --quick --only b   # rewrites (b) in docs/results.md, keeps the rest

The page's data (every experiment's numbers, read back when sections are merged) goes to
lab/results.json with the default --out, and next to --out (its name with .json) otherwise.

The experiments live in `agents.experiments` (one registered function each); this script
only parses arguments, runs them with stage lines on stderr, and writes the page.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from jaxserve.agents.experiments import BUDGETS, Context, run_experiments
from jaxserve.agents.experiments.report import write_results
from jaxserve.scripts.cli import Parser, run_cli

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "results.md"
# Raw data stays out of docs/ (the site): the lab notebook holds it (lab/README.md).
DEFAULT_DATA = ROOT / "lab" / "results.json"


def build_parser():
    ap = Parser(prog="reproduce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU budget (3 short seeds)")
    ap.add_argument("--budget", choices=("quick", "full", "tiny"), default=None,
                    help="budget by name (overrides --quick)")
    ap.add_argument("--only", default=None,
                    help="comma-separated experiment keys (default: all; \"\" runs none and "
                         "rewrites only the page's summary from the kept sections' data)")
    ap.add_argument("--out", default=str(DEFAULT_OUT),
                    help="markdown file to write (figures go to its figures/ folder)")
    ap.add_argument("--data", default=None,
                    help="JSON file for the page's data (default: lab/results.json with the "
                         "default --out, else --out with the suffix .json)")
    ap.add_argument("--figures", default=None,
                    help="figure folder (default: figures/ next to --out)")
    ap.add_argument("--fresh", action="store_true",
                    help="write a page of just the sections run (default: merge them into the "
                         "existing page, keeping the sections not run: with --only, the "
                         "others; without, those the budget skips)")
    ap.add_argument("--eval-seed", type=int, default=20261202, help="evaluation key seed")
    ap.add_argument("--no-progress", action="store_true", help="no stage lines")
    return ap


def main(argv=None) -> int:
    def body() -> int:
        args = build_parser().parse_args(argv)
        budget = BUDGETS[args.budget or ("quick" if args.quick else "full")]
        only = None if args.only is None else [k.strip() for k in args.only.split(",") if k]
        argv_ = sys.argv[1:] if argv is None else list(argv)
        command = " ".join(["python scripts/reproduce.py", *map(shlex.quote, argv_)])
        ctx = Context(budget, command, eval_seed=args.eval_seed, progress=not args.no_progress,
                      keep_going=True)
        t0 = time.perf_counter()
        sections = run_experiments(ctx, only)
        out = Path(args.out)
        if args.data is not None:
            data = Path(args.data)
        elif out.resolve() == DEFAULT_OUT.resolve():
            data = DEFAULT_DATA
        else:
            data = out.with_suffix(".json")
        figs = Path(args.figures) if args.figures else out.parent / "figures"
        # A run of every experiment keeps the sections its budget skips (e.g. the quick
        # budget's (f) and (x), written by `--only`) unless --fresh.
        merge = not args.fresh and (only is not None or bool(budget.skip))
        path = write_results(sections, ctx, out, figs, time.perf_counter() - t0, merge=merge,
                             json_path=data)
        failed = [s.key for s in sections if "failed" in s.data]
        print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)"
              + (f"; FAILED: {failed}" if failed else ""))
        return 1 if failed else 0
    return run_cli("reproduce", body)


if __name__ == "__main__":
    raise SystemExit(main())
