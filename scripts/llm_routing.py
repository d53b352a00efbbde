"""jaxserve-llm-routing: PPO against the LLMRouting-v0 heuristics on an Azure LLM trace.

Example (the docs/continuous.md experiment)::

    python -m jaxserve.scripts.llm_routing --trace conv --load 0.8 --seeds 0,1,2 --steps 40000 \
        --out runs/llm_routing

Trains PPO on a workload fitted to the first quarter of the trace and replays the rest, in
disjoint windows, under the learned policies and every heuristic
(`agents.experiments.llm_routing_study`). Prints markdown tables and writes `study.json` to
--out. Errors print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxserve.agents.experiments.llm_routing_study import format_study, run_study
from jaxserve.evaluation.serialize import to_jsonable
from jaxserve.scripts.cli import Parser, run_cli


def build_parser() -> Parser:
    ap = Parser(prog="jaxserve-llm-routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="conv", choices=("conv", "code"))
    ap.add_argument("--load", type=float, default=0.8,
                    help="offered load of the training window (rate / nominal capacity)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated PPO seeds")
    ap.add_argument("--steps", type=int, default=40_000, help="PPO env steps per seed")
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--window-requests", type=int, default=400)
    ap.add_argument("--eval-windows", type=int, default=6)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO (s)")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT SLO (s/token)")
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--queue-cap", type=int, default=16)
    ap.add_argument("--out", default="runs/llm_routing", help="output directory")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    def body():

        args = build_parser().parse_args(argv)
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)  # now, not after the study: a bad --out fails fast
        res = run_study(trace=args.trace, load=args.load, seeds=seeds, total_steps=args.steps,
                        num_envs=args.num_envs, window_requests=args.window_requests,
                        eval_windows=args.eval_windows, slo_ttft=args.slo_ttft,
                        slo_tpot=args.slo_tpot, max_seqs=args.max_seqs,
                        queue_cap=args.queue_cap, out_dir=str(out / "train"))
        res["command"] = "python -m jaxserve.scripts.llm_routing " + " ".join(
            sys.argv[1:] if argv is None else argv)
        with open(out / "study.json", "w") as f:
            json.dump(to_jsonable(res), f, indent=1)
        print(format_study(res))
        print(f"wrote {out / 'study.json'} ({res['seconds']:.0f} s)")
        return 0
    return run_cli("jaxserve-llm-routing", body)


if __name__ == "__main__":
    sys.exit(main())
