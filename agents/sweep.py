"""Hyperparameter sweeps as ONE compiled program: vmap over seeds and (lr, ent_coef, clip_eps).

The learning rate, the entropy coefficient and PPO's clip range are arrays in the runner state
(`agents.trainer.set_hparams`), so one program trains every grid point and seed at once: the
grid `lr x ent_coef x clip_eps` (H points) is the outer `vmap`, the seeds (S) the inner one, and
the whole run is `jit(vmap(vmap(init -> set_hparams -> lax.scan(update))))`. Everything else
(network, num_envs, rollout length...) fixes shapes and stays static. The command line is
`python -m jaxserve.scripts.sweep`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.agents.defaults import ALGOS, ENV_DEFAULTS, make_config
from jaxserve.agents.envs import make_env
from jaxserve.agents.trainer import run_updates, set_hparams, traced_hparam_names

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
        (the training defaults of `agents.defaults.ENV_DEFAULTS` apply the same way).
      grid: `{name: values}` for names in ("lr", "ent_coef", "clip_eps"); missing names keep
        the config's value. REINFORCE has no clip_eps.
      seeds: seeds; each run's key is `jax.random.key(seed)`, as in `agents.train`.

    Returns:
      A `SweepResult`.

    Raises:
      ValueError: unknown grid name, a value the config rejects, or no seeds.
    """


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
    # deferred: the Agg backend must be chosen before pyplot is imported, and only where a
    # figure is drawn, not for every importer of this module
    import matplotlib  # deferred: see above
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: see above

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
