"""What the experiments share: the run context, training seeds and scenarios in one program,
statistics across seeds, and markdown tables.

Statistics. A learned algorithm is trained with several seeds; its value of a metric is the
mean over seeds of each seed's value (each the mean over the evaluation environments), with a
95% Student-t CI across seeds (`stats.t_halfwidth`, S - 1 degrees of freedom): the seed is
the replicate. Against a heuristic evaluated on the same streams (common random numbers) the
comparison is paired: per seed, the mean over environments of (learned - heuristic); the CI
is again across seeds. `per_seed_wins` adds how many seeds are significantly better on their
own (the paired CI over environments, `stats.paired_difference`, below zero).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxserve.agents.defaults import ALGOS, make_config
from jaxserve.agents.imitation import warm_start
from jaxserve.agents.policy import LearnedPolicy
from jaxserve.agents.trainer import run_updates
from jaxserve.core.stats import paired_difference, t_halfwidth

LATENCY = "latency_incl_drops"  # the per-env replicate of the drop-inclusive mean latency


@dataclasses.dataclass
class Section:
    """One experiment's part of docs/results.md.

    Attributes:
      title: heading; body: markdown (tables, reading) written under it;
      figures: `{file name: callable(path)}` drawing each figure (docs/figures/...);
      data: numbers for tests and JSON; key, wall_s: set by `run_experiments`.
    """

    title: str
    body: str = ""
    figures: dict = dataclasses.field(default_factory=dict)
    data: dict = dataclasses.field(default_factory=dict)
    key: str = ""
    wall_s: float = 0.0


@dataclasses.dataclass
class Context:
    """State shared by the experiments of one run.

    Attributes:
      budget: the `Budget`; command: the command line that made the run (quoted in every
      table); eval_seed: evaluation key seed (tuning uses `tuning_key` of it); cache:
      results one experiment leaves for a later one; progress: print stage lines;
      keep_going: an experiment that fails becomes a section saying so.
    """

    budget: Any
    command: str
    eval_seed: int = 20261202
    cache: dict = dataclasses.field(default_factory=dict)
    progress: bool = True
    keep_going: bool = False
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    def log(self, msg: str) -> None:
        if self.progress:
            print(f"[{time.perf_counter() - self.t0:6.0f} s] {msg}", file=sys.stderr,
                  flush=True)

    def eval_key(self, salt: int = 0):
        """The evaluation key of experiment part `salt` (never a tuning key)."""
        return jax.random.fold_in(jax.random.PRNGKey(self.eval_seed), salt)


# ----------------------------------------------------------------------------- training

def stack_params(params_list: Sequence[Any]) -> Any:
    """Stacks scenario parameters along a new leading axis (leaves must have equal shapes).

    The tree structure of the first is used, so profiles that differ only in their (static)
    names stack too.
    """
    leaves = [jax.tree.leaves(p) for p in params_list]
    shapes = [[np.shape(x) for x in ls] for ls in leaves]
    if any(s != shapes[0] for s in shapes):
        raise ValueError("scenarios trained together need parameters of equal shapes")
    treedef = jax.tree.structure(params_list[0])
    return jax.tree.unflatten(treedef, [jnp.stack(xs) for xs in zip(*leaves)])


def train_scenarios(env_name: str, env, params_list: Sequence[Any], algo: str,
                    seeds: Sequence[int], total_steps: int, ctx: Context | None = None,
                    checkpoints: int = 1, imitation: dict | None = None,
                    progress: bool = False, **hparams):
    """Trains `algo` on every scenario x seed in ONE compiled program.

    The environment parameters are an argument of the program (vmapped over scenarios), the
    seeds an inner vmap; hyperparameters are `agents.defaults.ENV_DEFAULTS[env_name][algo]`,
    as `agents.train` uses them (`hparams` override them, e.g. `network="mlp"`), each run's
    key `jax.random.key(seed)`. With `checkpoints`
    = K > 1 the updates run as K equal chunks (the same updates, in the same order) and the
    network after each chunk is kept: the policies of a budget curve.

    Returns:
      (policies, curves): `policies[i][s]` the greedy `LearnedPolicy` of scenario i, seed s;
      `curves` `(num_scenarios, num_seeds, num_updates)` per-update episode returns, plus
      the env steps per update under `"env_steps"` and the timings; with `checkpoints` > 1,
      also `"checkpoint_policies"` (`[i][s][c]`, the last one the final policy) and
      `"checkpoint_steps"` (env steps at each checkpoint).

    With `imitation = {"policy": heuristic, "num_steps": T, "epochs": K, "lr": lr}` each run
    starts from the network fitted to the heuristic's decisions (`agents.imitation.imitate`:
    T steps of its num_envs training environments, K full-batch Adam steps) instead of the
    random initialisation; one scenario only (a fitted heuristic belongs to its scenario).
    The fitted networks are kept as `curves["imitation_policies"]` (`[i][s]`).

    `progress`: a tqdm bar on stderr, advanced after every update of the program (all runs
    update together) by a `jax.debug.callback` in the update loop; off by default, so that
    the program of a run without it has no host callback.
    """

    config = make_config(algo, env_name, env, int(total_steps), int(seeds[0]), **hparams)
    checkpoints = int(checkpoints)
    if checkpoints < 1 or config.num_updates % checkpoints:
        raise ValueError(f"checkpoints must be >= 1 and divide the {config.num_updates} "
                         f"updates, got {checkpoints}")
    chunk = config.num_updates // checkpoints
    network = ALGOS[algo][1](config, env, params_list[0]).network
    stacked = stack_params(params_list)
    if imitation is not None:
        imitation = dict(imitation)
        if len(params_list) != 1:
            raise ValueError("imitation trains one scenario per program (its heuristic is "
                             f"fitted to that scenario), got {len(params_list)}")
        unknown = sorted(set(imitation) - {"policy", "num_steps", "epochs", "lr"})
        if unknown or not callable(imitation.get("policy")):
            raise ValueError("imitation takes policy (callable), num_steps, epochs, lr; got "
                             f"{sorted(imitation)}")

    bar = None
    if progress:
        runs = len(params_list) * len(seeds)
        bar = tqdm(total=config.num_updates * config.batch_size, unit="step", unit_scale=True,
                   desc=f"{algo} on {env_name} ({runs} run{'s' * (runs > 1)}, steps each)",
                   file=sys.stderr, dynamic_ncols=True)

    def one(p, key):
        trainer = ALGOS[algo][1](config, env, p, network)

        def ticked(runner):  # the same update, then one tick of the bar
            runner, metrics = trainer.update(runner)
            jax.debug.callback(lambda: bar.update(config.batch_size))
            return runner, metrics
        update = trainer.update if bar is None else ticked
        runner = trainer.init(key)
        if imitation is not None:
            opts = {k: v for k, v in imitation.items() if k != "policy"}
            runner = warm_start(runner, env, p, imitation["policy"], config, **opts)
        # The start is an output only with imitation: the plain program stays as it was.
        start = runner.train_state.params if imitation is not None else None

        def run_chunk(runner, _):
            runner, metrics = run_updates(update, runner, chunk)
            return runner, (runner.train_state.params, metrics["episode_return"])

        _, (snapshots, returns) = jax.lax.scan(run_chunk, runner, None, checkpoints)
        return (snapshots, start), returns.reshape(-1)

    keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
    program = jax.jit(jax.vmap(jax.vmap(one, in_axes=(None, 0)), in_axes=(0, None)))
    t0 = time.perf_counter()
    compiled = program.lower(stacked, keys).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        (snapshots, starts), returns = jax.block_until_ready(compiled(stacked, keys))
    finally:
        if bar is not None:
            bar.close()
    run_s = time.perf_counter() - t0
    if ctx is not None:
        ctx.log(f"  trained {algo} on {env_name}: {len(params_list)} scenario(s) x "
                f"{len(seeds)} seed(s) x {config.num_updates * config.batch_size} steps "
                f"(compile {compile_s:.0f} s, run {run_s:.0f} s)")
    snapshots = jax.device_get(snapshots)  # leaves (scenario, seed, checkpoint, ...)
    starts = jax.device_get(starts)  # leaves (scenario, seed, ...); None without imitation

    def policy(i, s, c, name):
        return LearnedPolicy(network, jax.tree.map(lambda x: x[i, s, c], snapshots), True, name)

    pols = [[policy(i, s, checkpoints - 1, f"{algo}-s{seed}") for s, seed in enumerate(seeds)]
            for i in range(len(params_list))]
    curves = {"episode_return": np.asarray(returns, np.float64),
              "env_steps": np.arange(1, config.num_updates + 1) * config.batch_size,
              "compile_s": compile_s, "run_s": run_s}
    if checkpoints > 1:
        curves["checkpoint_steps"] = (np.arange(1, checkpoints + 1) * chunk
                                      * config.batch_size)
        curves["checkpoint_policies"] = [
            [[policy(i, s, c, f"{algo}-s{seed}@{c + 1}/{checkpoints}")
              for c in range(checkpoints)] for s, seed in enumerate(seeds)]
            for i in range(len(params_list))]
    if imitation is not None:
        curves["imitation_policies"] = [
            [LearnedPolicy(network, jax.tree.map(lambda x: x[i, s], starts), True,
                           f"{algo}-s{seed}@imitation") for s, seed in enumerate(seeds)]
            for i in range(len(params_list))]
    return pols, curves


def learned_dict(pols: dict[str, Sequence[Any]]) -> dict[str, Any]:
    """`{"ppo": [p0, p1, ...]}` -> `{"ppo-s0": p0, ...}` (the names evaluation tables use)."""
    return {p.name: p for algo_pols in pols.values() for p in algo_pols}


# ----------------------------------------------------------------------------- statistics

def seed_names(results: dict, algo: str) -> list[str]:
    return [k for k in results if k.startswith(algo + "-s")]


def env_mean(values) -> float:
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else float("nan")


def across_seeds(results: dict, algo: str, metric: str = LATENCY) -> tuple[float, float]:
    """(mean over seeds, 95% CI half-width across seeds) of a per-env metric."""
    vals = [env_mean(results[k]["per_env"][metric]) for k in seed_names(results, algo)]
    return float(np.mean(vals)), t_halfwidth(vals)


def paired_across_seeds(results: dict, algo: str, other: str, metric: str = LATENCY) -> dict:
    """Paired difference `algo - other` on common streams: per seed the mean over envs of
    the differences; mean and 95% CI across seeds; `wins`/`losses`: seeds whose own paired
    CI over environments lies below/above zero."""
    ref = results[other]["per_env"][metric]
    per_seed, wins, losses = [], 0, 0
    for k in seed_names(results, algo):
        d = paired_difference(results[k]["per_env"][metric], ref)
        per_seed.append(d["mean"])
        wins += d["significant"] and d["mean"] < 0
        losses += d["significant"] and d["mean"] > 0
    return {"mean": float(np.mean(per_seed)), "ci": t_halfwidth(per_seed),
            "wins": int(wins), "losses": int(losses), "seeds": len(per_seed)}


def metric_of(results: dict, name: str, metric: str) -> tuple[float, float]:
    """(value, CI) of policy or algorithm `name`: across seeds for an algorithm, across
    environments for a heuristic."""
    if name in results:
        v = results[name]["per_env"][metric]
        return env_mean(v), t_halfwidth(v)
    return across_seeds(results, name, metric)


def drops_of(results: dict, name: str) -> float:
    """Measured dropped requests (mean over seeds for an algorithm)."""
    if name in results:
        return float(results[name]["dropped"])
    return float(np.mean([results[k]["dropped"] for k in seed_names(results, name)]))


# ----------------------------------------------------------------------------- formatting

def fmt(x: float, ci: float | None = None, digits: int = 3) -> str:
    """`x ± ci` with `digits` significant digits ("n/a" for NaN; no CI when it is NaN)."""
    if x is None or not np.isfinite(x):
        return "n/a" if x is None or np.isnan(x) else ("inf" if x > 0 else "-inf")
    s = f"{x:.{digits}g}" if abs(x) >= 1e-3 else f"{x:.2g}"
    if ci is not None and np.isfinite(ci):
        s += f" ± {ci:.2g}"
    return s


def fmt_diff(d: dict) -> str:
    """A paired difference across seeds, with its per-seed verdict count."""
    s = fmt(d["mean"], d["ci"])
    return f"{s} ({d['wins']}/{d['seeds']} better, {d['losses']}/{d['seeds']} worse)"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def made_by(ctx: Context, experiment: str, extra: str = "") -> str:
    """The provenance line every table carries."""
    return (f"*Made by `{ctx.command}`, experiment ({experiment}); budget `{ctx.budget.name}`"
            f"{'; ' + extra if extra else ''}.*")
