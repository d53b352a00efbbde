"""Hyperparameter sweep as ONE compiled program: vmap over seeds and (lr, ent_coef, clip_eps).

Example::

    python -m jaxserve.scripts.sweep                                  # Routing-v0 PPO, 2 x 2 grid, 2 seeds
    python -m jaxserve.scripts.sweep --env CartPole-v1 --lr 3e-4,1e-3,3e-3 --ent-coef 0,0.01 \
        --clip-eps 0.1,0.2 --seeds 4 --total-steps 200000 --out runs/sweep-cartpole

The sweep itself is `agents.sweep.run_sweep` (one `jit(vmap(vmap(...)))` program over the
grid and the seeds; see there).

Prints one row per setting (final return: mean over seeds of each run's mean episode return
over its last 10% of updates, with the std over seeds), marks the best, saves `sweep.png`
(mean learning curve per setting), `sweep.csv` and `sweep.json` in `--out`.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from jaxserve.agents.sweep import DEFAULT_GRID, SWEPT, SweepResult, plot_sweep, run_sweep  # noqa: F401
from jaxserve.compile_cache import enable_compilation_cache
from jaxserve.scripts.cli import CLIError as _CLIError
from jaxserve.scripts.cli import Parser as _Parser
from jaxserve.scripts.cli import parse_pairs


def print_sweep(result: SweepResult, title: str) -> None:

    t = Table(title=title)
    names = list(result.settings[0])
    for n in names + ["final return (mean ± std over seeds)", "per seed"]:
        t.add_column(n, justify="right")
    for i, s in enumerate(result.settings):
        f = result.final_return[i]
        row = [f"{s[n]:g}" for n in names]
        row += [f"{np.nanmean(f):.4g} ± {np.nanstd(f):.3g}" if np.isfinite(f).any() else "nan",
                " ".join(f"{x:.4g}" for x in f)]
        t.add_row(*row, style="bold green" if i == result.best else None)
    Console(width=max(Console().width, 120)).print(t)


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise _CLIError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not vals:
        raise _CLIError(f"{flag} names no value")
    return vals


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="Routing-v0")
    ap.add_argument("--algo", default="ppo", choices=("ppo", "reinforce"))
    ap.add_argument("--lr", default=",".join(map(str, DEFAULT_GRID["lr"])))
    ap.add_argument("--ent-coef", default=",".join(map(str, DEFAULT_GRID["ent_coef"])))
    ap.add_argument("--clip-eps", default=None,
                    help="comma-separated clip ranges (PPO; default: the config's)")
    ap.add_argument("--seeds", type=int, default=2, help="number of seeds (0..N-1)")
    ap.add_argument("--total-steps", type=int, default=300_000, help="env steps per run")
    ap.add_argument("--num-envs", type=int, default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--hp", dest="hparams", action="append", default=[], metavar="KEY=VALUE",
                    help="other (static) config fields, e.g. num_steps=32")
    ap.add_argument("--out", default="runs/sweep")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 with one line on stderr for bad input). Runs
    with the persistent XLA compilation cache on (`jaxserve.compile_cache`), as the other
    CLIs do (`scripts.cli.run_cli`)."""
    enable_compilation_cache()
    try:
        args = build_parser().parse_args(argv)
        if args.seeds < 1:
            raise _CLIError("--seeds must be >= 1")
        grid = {"lr": _floats(args.lr, "--lr"), "ent_coef": _floats(args.ent_coef, "--ent-coef")}
        if args.clip_eps is not None:
            grid["clip_eps"] = _floats(args.clip_eps, "--clip-eps")
        overrides = parse_pairs(args.overrides, "--set")
        hparams = parse_pairs(args.hparams, "--hp")
        print(f"sweep: {args.algo} on {args.env}, grid {grid}, {args.seeds} seeds; compiling "
              f"one program...", file=sys.stderr, flush=True)
        res = run_sweep(args.env, overrides, args.algo, grid, list(range(args.seeds)),
                        args.total_steps, args.num_envs, **hparams)
    except (_CLIError, ValueError, TypeError, OSError) as e:
        print(f"sweep: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    runs = len(res.settings) * len(res.seeds)
    steps = runs * res.config.num_updates * res.config.batch_size
    title = (f"{args.algo} on {args.env}: {len(res.settings)} settings x {len(res.seeds)} seeds, "
             f"{res.config.num_updates * res.config.batch_size:,} steps each; compile "
             f"{res.compile_s:.0f} s, run {res.run_s:.0f} s ({steps / res.run_s:,.0f} steps/s)")
    print_sweep(res, title)
    best = res.settings[res.best]
    print("best: " + ", ".join(f"{k}={v:g}" for k, v in best.items())
          + f" (final return {np.nanmean(res.final_return[res.best]):.4g})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_sweep(res, out / "sweep.png", title.split(";")[0])
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(list(best) + [f"final_return_seed{s}" for s in res.seeds] + ["mean"])
        for i, s in enumerate(res.settings):
            w.writerow(list(s.values()) + list(res.final_return[i])
                       + [float(np.nanmean(res.final_return[i]))])
    doc = {"command": "python -m jaxserve.scripts.sweep " + " ".join(sys.argv[1:] if argv is None
                                                            else argv),
           "settings": res.settings, "seeds": res.seeds,
           "final_return": [[None if not np.isfinite(x) else float(x) for x in row]
                            for row in res.final_return],
           "best": best, "config": res.config.to_dict(), "compile_s": res.compile_s,
           "run_s": res.run_s}
    with open(out / "sweep.json", "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {out}/sweep.png, sweep.csv, sweep.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
