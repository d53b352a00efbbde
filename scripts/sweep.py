"""Hyperparameter sweep as ONE compiled program: vmap over seeds and (lr, ent_coef, clip_eps).

Example::

    python -m scripts.sweep                                  # Routing-v0 PPO, 2 x 2 grid, 2 seeds
    python -m scripts.sweep --env CartPole-v1 --lr 3e-4,1e-3,3e-3 --ent-coef 0,0.01 \
        --clip-eps 0.1,0.2 --seeds 4 --total-steps 200000 --out runs/sweep-cartpole

The learning rate, the entropy coefficient and PPO's clip range are arrays in the runner state
(`agents.trainer.set_hparams`), so one program trains every grid point and seed at once: the
grid `lr x ent_coef x clip_eps` (H points) is the outer `vmap`, the seeds (S) the inner one, and
the whole run is `jit(vmap(vmap(init -> set_hparams -> lax.scan(update))))`. Everything else
(network, num_envs, rollout length...) fixes shapes and stays static.

Prints one row per setting (final return: mean over seeds of each run's mean episode return
over its last 10% of updates, with the std over seeds), marks the best, saves `sweep.png`
(mean learning curve per setting), `sweep.csv` and `sweep.json` in `--out`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

SWEPT = ("lr", "ent_coef", "clip_eps")
DEFAULT_GRID = {"lr": (3e-4, 1e-3), "ent_coef": (0.0, 0.01), "clip_eps": (0.2,)}


@dataclasses.dataclass
class SweepResult:
    """Outcome of `run_sweep`.

    Attributes:
      settings: H dicts `{"lr", "ent_coef", "clip_eps"?}`, the grid in row-major order.
      seeds: the S seeds.
      curves: per-update metrics, numpy `(H, S, num_updates)` each.
      env_steps: `(num_updates,)` cumulative environment steps.
      final_return: `(H, S)`: mean finite episode return over the last 10% of updates.
      best: index of the setting with the highest mean final return.
      config: the base config; compile_s, run_s: seconds.
    """

    settings: list[dict[str, float]]
    seeds: list[int]
    curves: dict[str, np.ndarray]
    env_steps: np.ndarray
    final_return: np.ndarray
    best: int
    config: Any
    compile_s: float
    run_s: float


def final_returns(returns: np.ndarray, frac: float = 0.1) -> np.ndarray:
    """`(..., U)` per-update returns -> `(...)` nanmean over the last `frac` of the updates."""
    u = returns.shape[-1]
    return _nanmean(returns[..., max(0, u - max(1, int(round(frac * u)))):], axis=-1)


def _nanmean(x: np.ndarray, axis: int) -> np.ndarray:
    """`np.nanmean` without the all-NaN RuntimeWarning (all-NaN slices give NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, axis=axis)


def run_sweep(env_name: str, env_overrides: dict | None, algo: str, grid: dict[str, tuple],
              seeds: list[int], total_steps: int | None, num_envs: int | None = None,
              **hparams: Any) -> SweepResult:
    """Trains every (grid point, seed) pair in one jitted, doubly vmapped program.

    Args:
      env_name, env_overrides, algo, total_steps, num_envs, **hparams: as `agents.train`
        (the training defaults of `agents.train.ENV_DEFAULTS` apply the same way).
      grid: `{name: values}` for names in ("lr", "ent_coef", "clip_eps"); missing names keep
        the config's value. REINFORCE has no clip_eps.
      seeds: seeds; each run's key is `jax.random.key(seed)`, as in `agents.train`.

    Returns:
      A `SweepResult`.

    Raises:
      ValueError: unknown grid name, a value the config rejects, or no seeds.
    """
    import jax
    import jax.numpy as jnp

    from agents.train import ALGOS, ENV_DEFAULTS, make_config, make_env
    from agents.trainer import run_updates, set_hparams, traced_hparam_names

    if not seeds:
        raise ValueError("a sweep needs at least one seed")
    overrides = {**ENV_DEFAULTS.get(env_name, {}).get("env_overrides", {}),
                 **(env_overrides or {})}
    env, env_params = make_env(env_name, overrides)
    config = make_config(algo, env_name, env, total_steps, seeds[0], num_envs, **hparams)
    traced = traced_hparam_names(config)
    unknown = sorted(set(grid) - set(traced))
    if unknown:
        raise ValueError(f"cannot sweep {unknown} for {algo}: the traced hyperparameters are "
                         f"{list(traced)}")
    names = [n for n in SWEPT if n in grid]
    values = [tuple(float(v) for v in grid[n]) for n in names]
    if any(len(v) == 0 for v in values):
        raise ValueError("every swept hyperparameter needs at least one value")
    settings = [dict(zip(names, combo)) for combo in itertools.product(*values)]
    for s in settings:  # host-side validation of every value with the config's own checks
        dataclasses.replace(config, **s)
    trainer = ALGOS[algo][1](config, env, env_params)
    num_updates = config.num_updates

    def one_run(key, hp):
        runner = set_hparams(trainer.init(key), **hp)
        _, metrics = run_updates(trainer.update, runner, num_updates)
        return metrics

    hp_arrays = {n: jnp.asarray([s[n] for s in settings], jnp.float32) for n in names}
    keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
    program = jax.jit(jax.vmap(jax.vmap(one_run, in_axes=(0, None)), in_axes=(None, 0)))
    t0 = time.perf_counter()
    compiled = program.lower(keys, hp_arrays).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    metrics = jax.block_until_ready(compiled(keys, hp_arrays))
    run_s = time.perf_counter() - t0
    curves = {k: np.asarray(v, np.float64) for k, v in jax.device_get(metrics).items()}
    final = final_returns(curves["episode_return"])
    mean_final = np.where(np.isfinite(final), final, -np.inf).mean(axis=1)
    env_steps = np.arange(1, num_updates + 1, dtype=np.float64) * config.batch_size
    return SweepResult(settings, list(seeds), curves, env_steps, final,
                       int(np.argmax(mean_final)), config, compile_s, run_s)


def plot_sweep(result: SweepResult, path, title: str = "") -> None:
    """Mean (over seeds) episode-return curve of every setting; the best one bold."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ret = result.curves["episode_return"]
    for i, s in enumerate(result.settings):
        mean = _nanmean(ret[i], axis=0)
        ok = np.isfinite(mean)
        label = ", ".join(f"{k}={v:g}" for k, v in s.items())
        ax.plot(result.env_steps[ok], mean[ok], lw=2.4 if i == result.best else 1.0,
                label=label + (" (best)" if i == result.best else ""))
    ax.set_xlabel("environment steps")
    ax.set_ylabel(f"mean episode return (mean of {len(result.seeds)} seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_sweep(result: SweepResult, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

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


class _CLIError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _CLIError(message)


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
    """Entry point; returns the exit status (2 with one line on stderr for bad input)."""
    from scripts.train import parse_pairs
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
    doc = {"command": "python -m scripts.sweep " + " ".join(sys.argv[1:] if argv is None
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
