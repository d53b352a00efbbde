"""jaxserve-train: train PPO or REINFORCE on an environment, then compare it with the heuristics.

Example::

    jaxserve-train                                   # PPO on Routing-v0, a few minutes on CPU
    jaxserve-train --env Routing-v0 --set arrival_rate=2.5 --set slo_s=10 --seed 1
    jaxserve-train --algo reinforce --total-steps 2000000 --lr 3e-4 --out runs/rf
    jaxserve-train --out runs/rf --algo reinforce --total-steps 2000000 --lr 3e-4 --resume

Trains with `agents.train` (progress bar, `metrics.csv`, orbax checkpoints, learning-curve
plot in `--out`, default `runs/<env>-<algo>-<seed>`), then evaluates the greedy learned policy
and the environment's heuristics (Routing-v0: random, round_robin, jsq, sed,
least_work_left, sita; Batching-v0: static, tuned_static, smdp_optimal; Autoscaling-v0:
every fixed replica count, hpa, knative, ray_serve, scheduled) with `jaxserve.evaluate_many`
(Autoscaling-v0: `jaxserve.evaluation.scaling.evaluate_autoscalers`, cost and GPU-hours) on
fresh arrivals (key `--eval-seed`, default seed + 1000000, never
the training key) with common random numbers across policies, prints a table (mean latency of
served requests, drop-inclusive mean latency, p99 latency, goodput, drops, 95% CIs) and the
verdicts: paired differences learned - baseline of the drop-inclusive mean latency (Student-t
CI over the per-environment differences on the common streams): "better", "worse" or "no
significant difference". Fitted baselines (sita, tuned_static, smdp_optimal) are fitted with
`tuning_key(eval key)`, never on the evaluation streams. Writes `results.json` and
`results.csv`. gymnax
environments (e.g. CartPole-v1) are trained but not evaluated. Errors print one line on
stderr and exit with status 2; Ctrl-C saves a checkpoint of the finished chunks (none before
the first chunk finishes, and the message says so) and exits with status 130.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from jaxserve import agents
# The comparison itself is library code (agents.evaluate).
from jaxserve.agents.evaluate import EVAL_SEED_OFFSET, VERDICT_METRIC
from jaxserve.agents.evaluate import evaluate_run as evaluate
from jaxserve.agents.evaluate import paired_verdicts
from jaxserve.agents.checkpoint import latest_step
from jaxserve.agents.run_dir import CHECKPOINT_DIR, check_out_dir
from jaxserve.agents.train import make_env
from jaxserve.envs.base import policy_kind
from jaxserve.evaluation.serialize import to_jsonable
from jaxserve.scripts.cli import CLIError as _CLIError
from jaxserve.scripts.cli import Parser as _Parser
from jaxserve.scripts.cli import parse_pairs, run_cli

# Registered environments whose learned policies other commands compare with the heuristics.
_COMPARED_ELSEWHERE = {
    "LLMRouting-v0": "the LLM routers are compared by `python -m jaxserve.scripts.llm_routing` and "
                     "experiment (f) of scripts/reproduce.py",
    "LLMPrefixRouting-v0": "the prefix routers are compared by `python -m jaxserve.scripts.prefix_study` "
                           "(experiment (p)) and `python -m jaxserve.scripts.prefix_routers`",
}

# Hyperparameter flags: (flag, config field, type).
HPARAM_FLAGS = (
    ("--lr", "lr", float), ("--ent-coef", "ent_coef", float), ("--clip-eps", "clip_eps", float),
    ("--num-steps", "num_steps", int), ("--gamma", "gamma", float),
    ("--gae-lambda", "gae_lambda", float), ("--vf-coef", "vf_coef", float),
    ("--update-epochs", "update_epochs", int), ("--num-minibatches", "num_minibatches", int),
    ("--max-grad-norm", "max_grad_norm", float), ("--network", "network", str),
    ("--set-mixer", "set_mixer", str),
)




def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="jaxserve-train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="Routing-v0",
                    help="jaxserve id (Routing-v0, Batching-v0) or gymnax id (CartPole-v1, ...)")
    ap.add_argument("--algo", default="ppo", choices=("ppo", "reinforce"))
    ap.add_argument("--total-steps", type=int, default=None,
                    help="environment steps (default: the environment's tuned budget)")
    ap.add_argument("--num-envs", type=int, default=None, help="parallel training environments")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="run directory (default runs/<env>-<algo>-<seed>)")
    ap.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a run saved in --out, or write into a non-empty --out that "
                         "holds no run")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="environment override, repeatable (e.g. arrival_rate=2.5, slo_s=10)")
    for flag, field, typ in HPARAM_FLAGS:
        ap.add_argument(flag, dest=field, type=typ, default=None, help=f"config.{field}")
    ap.add_argument("--hidden-sizes", default=None, help="comma-separated widths, e.g. 64,64")
    ap.add_argument("--hp", dest="hparams", action="append", default=[], metavar="KEY=VALUE",
                    help="any other config field, repeatable (e.g. anneal_lr=false)")
    ap.add_argument("--checkpoint-every", type=int, default=5, help="chunks between checkpoints")
    ap.add_argument("--chunk-updates", type=int, default=None,
                    help="updates per jitted chunk (default: about 25 chunks per run)")
    ap.add_argument("--eval-set", dest="eval_overrides", action="append", default=[],
                    metavar="KEY=VALUE",
                    help="environment override for the evaluation only, repeatable (e.g. "
                         "workload=azure_conv: train on the fitted MMPP, test on the replay)")
    ap.add_argument("--eval-envs", type=int, default=16, help="evaluation replicates")
    ap.add_argument("--eval-steps", type=int, default=None,
                    help="requests per replicate (default 1000); Autoscaling-v0: control "
                         "intervals (default: one episode)")
    ap.add_argument("--eval-seed", type=int, default=None,
                    help=f"evaluation seed (default seed + {EVAL_SEED_OFFSET}: fresh arrivals)")
    ap.add_argument("--policies", default=None,
                    help="comma-separated heuristics to compare (default: the env's baselines)")
    ap.add_argument("--sampled", action="store_true",
                    help="also evaluate the sampling (non-greedy) learned policy")
    ap.add_argument("--imitate", default=None, metavar="HEURISTIC",
                    help="start from a network fitted to this heuristic's decisions "
                         "(agents.imitation), e.g. sita_predicted")
    ap.add_argument("--no-eval", action="store_true", help="train only")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def hparams_from_args(args) -> dict:
    hp = parse_pairs(args.hparams, "--hp")
    for _, field, _ in HPARAM_FLAGS:
        v = getattr(args, field)
        if v is not None:
            hp[field] = v
    if args.hidden_sizes is not None:
        try:
            hp["hidden_sizes"] = tuple(int(h) for h in args.hidden_sizes.split(",") if h.strip())
        except ValueError:
            raise _CLIError(f"--hidden-sizes must be comma-separated ints, got "
                            f"{args.hidden_sizes!r}") from None
    return hp


SCALARS = ("mean_latency", "mean_latency_ci95", "mean_latency_incl_drops",
           "mean_latency_incl_drops_ci95", "p50_latency", "p90_latency", "p99_latency",
           "p99_latency_ci95", "throughput", "throughput_ci95", "goodput", "goodput_ci95",
           "slo_attainment", "dropped", "drop_rate", "cost_per_request", "cost_ci95",
           "invalid_actions")


def print_table(results: dict, title: str, learned: str) -> None:

    def ci(v, h, fmt="{:.2f}"):
        return fmt.format(v) + ("" if not np.isfinite(h) else " ± " + fmt.format(h))

    t = Table(title=title)
    for col in ("policy", "mean latency (s)", "incl. drops (s)", "p99 latency (s)",
                "goodput (req/s)", "throughput", "SLO met", "drops"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name, r in sorted(results.items(), key=lambda kv: kv[1]["mean_latency_incl_drops"]):
        style = "bold green" if name.startswith(learned) else None
        t.add_row(name, ci(r["mean_latency"], r["mean_latency_ci95"]),
                  ci(r["mean_latency_incl_drops"], r["mean_latency_incl_drops_ci95"]),
                  ci(r["p99_latency"], r["p99_latency_ci95"], "{:.1f}"),
                  ci(r["goodput"], r["goodput_ci95"], "{:.3f}"), f"{r['throughput']:.3f}",
                  f"{100 * r['slo_attainment']:.1f}%", str(r["dropped"]), style=style)
    Console(width=max(Console().width, 120)).print(t)
    print("mean latency: served requests only (drops excluded); incl. drops: every request, a "
          "dropped one at the env's drop_penalty_s")


def print_verdicts(verdicts: dict, learned: str) -> None:
    for name, v in verdicts.items():
        d = v["difference"]
        print(f"  {learned} - {name}: incl. drops {d[VERDICT_METRIC]['mean']:+.2f} "
              f"[{d[VERDICT_METRIC]['low']:+.2f}, {d[VERDICT_METRIC]['high']:+.2f}] s, "
              f"mean latency {d['mean_latency']['mean']:+.2f} ± {d['mean_latency']['ci']:.2f} s,"
              f" goodput {d['goodput']['mean']:+.3f} ± {d['goodput']['ci']:.3f} req/s: "
              f"{learned} {v['verdict']}" if v["verdict"] != "no significant difference" else
              f"  {learned} - {name}: incl. drops {d[VERDICT_METRIC]['mean']:+.2f} "
              f"[{d[VERDICT_METRIC]['low']:+.2f}, {d[VERDICT_METRIC]['high']:+.2f}] s: "
              f"no significant difference")
    print("(paired differences on common streams, 95% Student-t CI over environments)")


def print_winner(results: dict, verdicts: dict, learned: str) -> str:
    """Prints (and returns) which policy wins: the best heuristic by drop-inclusive mean
    latency, and the learned policy's paired verdict against it."""
    heur = {n: r for n, r in results.items() if n in verdicts}
    best = min(heur, key=lambda n: heur[n][VERDICT_METRIC])
    v = verdicts[best]["verdict"]
    line = (f"best heuristic: {best} ({heur[best][VERDICT_METRIC]:.2f} s incl. drops; "
            f"{learned} {results[learned][VERDICT_METRIC]:.2f} s): "
            + (f"{learned} wins" if v == "better" else f"{best} wins" if v == "worse"
               else "no significant difference"))
    print(line)
    return line


AUTOSCALING_SCALARS = ("cost", "cost_ci95", "gpu_hours", "gpu_hours_ci95", "mean_replicas",
                       "mean_latency", "mean_latency_ci95", "slo_violation_rate", "drop_rate",
                       "in_flight", "return")


def print_scaling_table(results: dict, title: str, learned: str) -> None:
    """Rich table of autoscalers: cost (request-seconds), GPU-hours, latency, SLO, drops."""

    t = Table(title=title)
    for col in ("policy", "cost (req-s)", "GPU-hours", "replicas", "mean latency (s)",
                "SLO violated", "drops"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name, r in sorted(results.items(), key=lambda kv: kv[1]["cost"]):
        style = "bold green" if name.startswith(learned) else None
        t.add_row(name, f"{r['cost']:,.0f} ± {r['cost_ci95']:,.0f}",
                  f"{r['gpu_hours']:.2f}", f"{r['mean_replicas']:.2f}",
                  f"{r['mean_latency']:.1f} ± {r['mean_latency_ci95']:.1f}",
                  f"{100 * r['slo_violation_rate']:.1f}%", f"{100 * r['drop_rate']:.2f}%",
                  style=style)
    Console(width=max(Console().width, 120)).print(t)


def evaluate_run(result, args) -> tuple[dict, dict]:
    """`agents.evaluate.evaluate_run` with the CLI's arguments."""
    return evaluate(result, seed=args.seed, eval_seed=args.eval_seed, eval_envs=args.eval_envs,
                    eval_steps=args.eval_steps,
                    eval_overrides=parse_pairs(args.eval_overrides, "--eval-set"),
                    policies=args.policies, sampled=args.sampled)


def run(args, argv) -> int:
    if args.num_envs is not None and args.num_envs < 1:
        raise _CLIError("--num-envs must be >= 1")
    if args.total_steps is not None and args.total_steps < 1:
        raise _CLIError("--total-steps must be >= 1")
    if args.eval_envs < 2 or (args.eval_steps is not None and args.eval_steps < 1):
        raise _CLIError("--eval-envs must be >= 2 (for CIs) and --eval-steps >= 1")
    if args.checkpoint_every < 1:
        raise _CLIError("--checkpoint-every must be >= 1")
    overrides = parse_pairs(args.overrides, "--set")
    hparams = hparams_from_args(args)
    out = Path(args.out or f"runs/{args.env}-{args.algo}-{args.seed}")


    make_env(args.env, overrides)  # fail fast, before compiling anything
    # Before training: refuse what would overwrite files without a word, in the CLI's terms.
    check_out_dir(out, resume=args.resume, overwrite=args.overwrite, resume_flag="--resume",
                  overwrite_flag="--overwrite", out_flag="--out", refuse_foreign=True)
    t0 = time.perf_counter()
    try:
        result = agents.train(args.env, overrides, args.algo, args.total_steps, args.seed,
                              num_envs=args.num_envs, progress=not args.no_progress,
                              out_dir=out, checkpoint_every=args.checkpoint_every,
                              resume=args.resume, overwrite=args.overwrite,
                              chunk_updates=args.chunk_updates, imitate=args.imitate,
                              **hparams)
    except KeyboardInterrupt:
        # `agents.train` saves what it finished before re-raising: say what is there.
        step = latest_step(out / CHECKPOINT_DIR)
        if step is None:
            print(f"jaxserve-train: interrupted before the first chunk finished; no checkpoint "
                  f"saved yet in {out}, so there is nothing to --resume: run the same command "
                  f"again", file=sys.stderr)
        else:
            again = ("the same command" + ("" if args.resume else " plus --resume")
                     + (" and without --overwrite" if args.overwrite else ""))
            print(f"jaxserve-train: interrupted; checkpoint at update {step} in "
                  f"{out / CHECKPOINT_DIR}, continue with {again}", file=sys.stderr)
        return 130
    cfg = result.config
    total = f"{cfg.num_updates} updates, {cfg.num_updates * cfg.batch_size:,} env steps"
    if result.resumed_from == cfg.num_updates:
        what = f"loaded the finished run in {out} ({total}, no training)"
    else:
        resumed = (f", resumed at update {result.resumed_from}" if result.resumed_from else "")
        what = (f"trained {result.algo} on {result.env_name}: {total} in "
                f"{result.wall_time_s:.1f} s (compile {result.compile_time_s:.1f} s{resumed})")
    ret = result.final_return()
    ret_text = (f"final return {ret:.4g}" if np.isfinite(ret) else
                "no episode finished yet (final return undefined: train longer than one episode)")
    print(f"{what}; {ret_text}; overrides {result.env_overrides}")

    doc = {"command": "jaxserve-train " + " ".join(sys.argv[1:] if argv is None else argv),
           "env": args.env, "algo": args.algo, "seed": args.seed,
           "env_overrides": result.env_overrides, "config": cfg.to_dict(),
           "train_wall_s": result.wall_time_s, "compile_s": result.compile_time_s,
           "final_return": result.final_return(), "checkpoints": str(out / "checkpoints")}
    results = {}
    try:
        policy_kind(result.env)
        evaluable = True
    except ValueError:
        evaluable = False
    if evaluable and not args.no_eval:
        results, info = evaluate_run(result, args)
        doc["evaluation"] = info
        scaling = "cost" in next(iter(results.values()))
        if scaling:
            title = (f"{args.env}: {args.eval_envs} episodes of "
                     f"{next(iter(results.values()))['intervals']:.0f} intervals, eval seed "
                     f"{info['eval_seed']} (fresh arrivals; 95% CIs over episodes)")
            print_scaling_table(results, title, args.algo)
            columns = AUTOSCALING_SCALARS
            # evaluate_autoscalers reports no per-episode values to pair: a point comparison,
            # labelled as such.
            learned = results[args.algo]["cost"]
            doc["learned_beats_on_cost_unpaired"] = {
                n: bool(learned < r["cost"]) for n, r in results.items()
                if not n.startswith(args.algo)}
        else:
            title = (f"{args.env}: {args.eval_envs} envs x {args.eval_steps or 1000} requests, "
                     f"eval seed {info['eval_seed']} (fresh arrivals; 95% CIs over envs)")
            print_table(results, title, args.algo)
            columns = SCALARS
            verdicts = paired_verdicts(results, args.algo)
            print_verdicts(verdicts, args.algo)
            if verdicts:
                doc["winner"] = print_winner(results, verdicts, args.algo)
            doc["verdict_metric"] = VERDICT_METRIC
            doc["verdicts"] = verdicts
        doc["results"] = {n: {k: r[k] for k in columns}
                          | ({} if scaling else {"utilisation": r["utilisation"]})
                          for n, r in results.items()}
        with open(out / "results.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["policy", *columns])
            for n, r in results.items():
                w.writerow([n, *[r[k] for k in columns]])
    elif not evaluable and not args.no_eval:
        print(f"no heuristic comparison for {args.env} here: "
              + _COMPARED_ELSEWHERE.get(args.env, "not a jaxserve serving environment"))
    doc["total_wall_s"] = time.perf_counter() - t0
    with open(out / "results.json", "w") as f:
        json.dump(to_jsonable(doc), f, indent=1)
    print(f"wrote {out}/ (checkpoints, metrics.csv, learning_curve.png, results.json"
          + (", results.csv)" if results else ")"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point (`jaxserve-train`); returns the exit status."""
    def body():
        args = build_parser().parse_args(argv)
        return run(args, argv)
    return run_cli("jaxserve-train", body)

if __name__ == "__main__":
    sys.exit(main())
