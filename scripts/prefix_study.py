"""jaxserve-prefix-study: PPO or REINFORCE against every prefix-cache-aware and load-only router.

Example (one configuration of experiment (p), at its quick budget)::

    python -m jaxserve.scripts.prefix_study --workload system_prompts --load 1.0 --seeds 0,1,2 \
        --steps 32768 --windows 4 --out runs/prefix_study/system_prompts_1.json

Trains PPO (LLMPrefixRouting-v0's settings on the environment as registered: ranked replicas,
unshaped reward) on the workload's training trace and replays disjoint
evaluation windows under the learned policies and every router
(`agents.experiments.prefix_study`: workloads, loads and statistics). Progress lines go to
stderr (the study takes minutes); the markdown tables to stdout; the result as JSON to --out.
`--plot` draws the trade-off and when each router leaves the cache; `--save-policies` keeps the
learned networks and `--policies-from` evaluates them again without training (e.g. against a
heuristic added since); `--from-json` renders the tables and plot of an earlier run's result.
Besides the routers at their published defaults the study runs four heuristics fitted on the
training windows: `llmd_tuned` (llm-d's scorer weights), `guarded_tuned` (`most_cached` with a
load guard), `sglang_tuned` and `aibrix_tuned` (SGLang's and AIBrix's thresholds);
`--no-tuned` leaves them out.
Errors print one line on stderr and exit with status 2 (output paths are checked first).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
from flax import serialization

from jaxserve.agents.experiments.prefix_study import (WORKLOADS, format_prefix_study, plot_cache_use,
                                             run_prefix_study)
from jaxserve.evaluation.serialize import to_jsonable
from jaxserve.scripts.cli import CLIError, Parser, output_file, run_cli


def read_saved_networks(path: str, flag: str) -> dict:
    """`{name: params}` of a `--save-policies` file; `CLIError` naming `flag` otherwise."""
    try:
        saved = serialization.msgpack_restore(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as e:
        raise CLIError(f"{flag} {path}: not a saved policies file "
                       f"({type(e).__name__}: {e})") from e
    if not isinstance(saved, dict) or not saved:
        raise CLIError(f"{flag} {path}: no networks in it")
    return saved


def build_parser() -> Parser:
    ap = Parser(prog="jaxserve-prefix-study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="system_prompts", choices=WORKLOADS)
    ap.add_argument("--load", type=float, default=1.0,
                    help="load multiplier: of the scenario's rate (system_prompts) or of the "
                         "capacity measured on the training windows (mooncake)")
    ap.add_argument("--algo", default="ppo", choices=("ppo", "reinforce"),
                    help="the learning algorithm (LLMPrefixRouting-v0's settings for it)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--steps", type=int, default=32_768, help="env steps per seed")
    ap.add_argument("--windows", type=int, default=4, help="evaluation windows (>= 2)")
    ap.add_argument("--train-windows", type=int, default=None,
                    help="windows the best heuristic is chosen and the fitted routers are "
                         "fitted on: mooncake, in the training part (default: --windows); "
                         "system_prompts, generator seeds 0..N-1 (default 1: the training "
                         "trace)")
    ap.add_argument("--window-requests", type=int, default=512, help="requests per window")
    ap.add_argument("--heuristics", default=None,
                    help="comma-separated routers (default: all of prefix_study.HEURISTICS)")
    ap.add_argument("--eval-seed", type=int, default=20261202, help="evaluation key seed")
    ap.add_argument("--out", default=None, help="JSON file for the result")
    ap.add_argument("--save-policies", default=None, metavar="FILE",
                    help="msgpack file for the learned networks' parameters ({name: params}, "
                         "flax.serialization; the network is LLMPrefixRouting-v0's default)")
    ap.add_argument("--policies-from", default=None, metavar="FILE",
                    help="evaluate the networks a run saved with --save-policies instead of "
                         "training (their seeds replace --seeds; pass the run's --steps to "
                         "record it)")
    ap.add_argument("--no-tuned", action="store_true",
                    help="leave out the heuristics fitted on the training windows "
                         "(llmd_tuned: llm-d's scorer weights; guarded_tuned: most_cached's "
                         "load guard; sglang_tuned, aibrix_tuned: their routers' thresholds)")
    ap.add_argument("--from-json", default=None, metavar="FILE",
                    help="render the tables (and --plot) of a result an earlier run wrote with "
                         "--out, without running the study")
    ap.add_argument("--plot", default=None, metavar="FILE",
                    help="PNG: hit rate against time in system per policy, and when each "
                         "router leaves the most-cached replica (prefix_study.plot_cache_use)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    def body():

        args = build_parser().parse_args(argv)
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        heur = (None if args.heuristics is None else
                [h.strip() for h in args.heuristics.split(",") if h.strip()])
        out = output_file(args.out, "--out")  # checked now: the study may take an hour
        saved = output_file(args.save_policies, "--save-policies")
        plot = output_file(args.plot, "--plot")
        if args.from_json is not None:
            try:
                res = json.loads(Path(args.from_json).read_text())
                text = format_prefix_study(res)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CLIError(f"--from-json {args.from_json}: not a prefix study's result "
                               f"({type(e).__name__}: {e})") from e
            print(text)
            if plot is not None:
                print(f"wrote {plot_cache_use(res, plot)}")
            return 0
        trained = None
        if args.policies_from is not None:
            trained = read_saved_networks(args.policies_from, "--policies-from")
        t0 = time.perf_counter()

        def log(msg: str) -> None:
            print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)

        res = run_prefix_study(workload=args.workload, load=args.load, seeds=seeds,
                               total_steps=args.steps, eval_windows=args.windows,
                               train_windows=args.train_windows,
                               window_requests=args.window_requests, heuristics=heur,
                               eval_seed=args.eval_seed, log=log,
                               keep_policies=saved is not None, progress=True,
                               tune=not args.no_tuned, trained=trained,
                               algo=args.algo)
        pols = res.pop("policies", {})
        res["command"] = "python -m jaxserve.scripts.prefix_study " + " ".join(
            sys.argv[1:] if argv is None else argv)
        print(format_prefix_study(res))
        if out is not None:
            out.write_text(json.dumps(to_jsonable(res), indent=1))
            print(f"wrote {out} ({res['seconds']:.0f} s)")
        if saved is not None:  # before the plot: the networks are what an hour bought
            saved.write_bytes(serialization.to_bytes(
                jax.device_get({name: p.params for name, p in pols.items()})))
            print(f"wrote {saved}")
        if plot is not None:
            print(f"wrote {plot_cache_use(res, plot)}")
        return 0
    return run_cli("jaxserve-prefix-study", body)


if __name__ == "__main__":
    sys.exit(main())
