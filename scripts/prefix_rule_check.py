"""jaxserve-prefix-rule-check: does a written rule reproduce a learned prefix router?

Example (the check of docs/prefix_caching.md, "What the learned routers do at load 1.5")::

    python -m jaxserve.scripts.prefix_rule_check --policies lab/prefix_study_1m/system_prompts_1.5_policies.msgpack \
        --network ppo_seed0 --load 1.5 --windows 8

Replays a network saved by `scripts/prefix_study.py --save-policies` beside `most_cached` and
the unregistered rule `policies.prefix_routing.cache_or_shed` on the study's evaluation
windows of a system_prompts load (`prefix_study.replay_windows`, the study's keys: the same
numbers as the study's tables), and prints each one's mean time in system (drops at the
penalty), drops and hit rate per window. Identical rows mean the rule reproduces the network's
outcomes on those windows (it prints in how many windows every metric is equal). Errors print
one line on stderr and exit with status 2.
"""

from __future__ import annotations

import sys

import numpy as np

from jaxserve.agents.experiments import prefix_study as P
from jaxserve.policies import prefix_routing as PR
from jaxserve.scripts.cli import CLIError, Parser, run_cli
from jaxserve.scripts.prefix_study import read_saved_networks


def build_parser() -> Parser:
    ap = Parser(prog="jaxserve-prefix-rule-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", required=True, metavar="FILE",
                    help="msgpack of saved networks (prefix_study --save-policies)")
    ap.add_argument("--network", default="ppo_seed0", help="which saved network")
    ap.add_argument("--load", type=float, default=1.5, help="system_prompts load")
    ap.add_argument("--windows", type=int, default=8, help="evaluation windows (>= 2)")
    ap.add_argument("--eval-seed", type=int, default=20261202, help="the study's key seed")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    def body():
        args = build_parser().parse_args(argv)
        saved = read_saved_networks(args.policies, "--policies")
        if args.network not in saved:
            raise CLIError(f"--network {args.network!r} is not in {args.policies}")
        algo = args.network.split("_seed")[0]
        wl = P.build_workload("system_prompts", args.load, window_requests=512,
                              eval_windows=args.windows, log=lambda msg: None)
        env, params = P.make_llm_prefix_routing(trace=wl["train_trace"],
                                                replicas=wl["replicas"])
        pols, _ = P.load_trained(env, params, {args.network: saved[args.network]}, 1, algo)
        env_w, params_w = P._build(wl["eval_windows"], wl["replicas"], params.tokens)
        keys = P.window_keys(args.eval_seed, "eval", args.windows)
        out = P.replay_windows(env_w, params_w, wl["eval_windows"],
                               {"most_cached": PR.most_cached,
                                "cache_or_shed": PR.cache_or_shed},
                               {args.network: pols[0]}, keys=keys)
        h = P.HEADLINE
        for name, d in out.items():
            print(f"{name:16s} time in system {d[h].mean():7.2f} s, drops/window "
                  f"{d['dropped'].mean():5.1f}, hit rate {d['token_hit_rate'].mean():.3f}; "
                  f"per window {np.round(d[h], 2).tolist()}")
        rule, net = out["cache_or_shed"], out[args.network]
        same = np.all([np.asarray(rule[m]) == np.asarray(net[m]) for m in P.METRICS], axis=0)
        print(f"cache_or_shed equals {args.network} on every metric in {int(same.sum())} of "
              f"{args.windows} windows; mean time in system differs by "
              f"{float(np.mean(rule[h]) - np.mean(net[h])):+.3f} s")
        return 0
    return run_cli("jaxserve-prefix-rule-check", body)


if __name__ == "__main__":
    sys.exit(main())
