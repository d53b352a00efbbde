"""One call from an environment name to a trained, checkpointed, evaluable policy.

    result = agents.train("Routing-v0", {"arrival_rate": 2.5}, "ppo", 2_000_000, seed=0,
                          out_dir="runs/demo", checkpoint_every=10)
    jaxserve.evaluate(result.env, result.env_params, result.policy, key)  # greedy router

The loop runs the agent's jitted `train_chunk` (a `lax.scan` of updates) chunk after chunk;
between chunks, on the host, it updates a tqdm bar (env steps/s, latest episode return),
appends the chunk's per-update metrics to `out_dir/metrics.csv` and, every `checkpoint_every`
chunks and at the end, writes an orbax checkpoint (`agents.checkpoint`: runner state with
params and optimizer state, the config as JSON, and metadata: env name and overrides,
algorithm, the learning curves so far, wall time). `resume=True` restores the newest
checkpoint and continues: the result is bit-identical to an uninterrupted run, because all
randomness lives in the runner state and chunking does not change the computation.

Environments: a jaxserve id (`jaxserve.make(name, **overrides)`) or any gymnax id with a
discrete action space (`gymnax.make(name)`, overrides replace fields of its `EnvParams`).
Networks: environments with an `obs_layout` (Routing-v0) get the permutation-equivariant
`SetActorCritic` by default, the rest an MLP. Tuned algorithm hyperparameters per environment
live in `agents.defaults.ENV_DEFAULTS` (docs/training.md records how they were chosen); the
environments are the registered ones (only Autoscaling-v0 trains with environment overrides).
The pieces: `agents.envs` (make_env), `agents.defaults` (ENV_DEFAULTS, make_config),
`agents.policy` (LearnedPolicy), `agents.run_dir` (CSV, plot, checkpoint metadata, restore);
this module holds the loop.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np
from tqdm import tqdm

from jaxserve.agents import imitation
from jaxserve.agents.checkpoint import save_checkpoint
from jaxserve.agents.config import TrainConfig
from jaxserve.agents.defaults import ALGOS, ENV_DEFAULTS, make_config
from jaxserve.agents.envs import make_env
from jaxserve.agents.policy import LearnedPolicy
from jaxserve.agents.rollout import RunnerState
from jaxserve.agents.run_dir import (CHECKPOINT_DIR, CURVE_PNG, METRICS_CSV, _metadata, _restore, _write_csv,
                            check_out_dir, jsonable_overrides, plot_learning_curve)
from jaxserve.agents.sharding import shard_trainer
from jaxserve.agents.trainer import Trainer

__all__ = ["ALGOS", "ENV_DEFAULTS", "LearnedPolicy", "TrainResult", "chunk_size", "make_config",
           "make_env", "train"]


@dataclasses.dataclass
class TrainResult:
    """What `train` returns.

    Attributes:
      env_name, env_overrides, algo: what was trained.
      config: the full training config.
      env, env_params: the environment and its parameters.
      network: the actor-critic module; params: its trained parameters.
      runner_state: the final runner state (params, optimizer state, envs, key).
      curves: per-update numpy arrays: `update` (1-based), `env_steps` (cumulative),
        `wall_time_s` (cumulative over sessions, at the end of the update's chunk), and every
        metric of the agent's update (`episode_return` (NaN when no episode ended in that
        update), `episode_length`, `num_episodes`, `total_loss`, `actor_loss`,
        `value_loss`, `entropy`, PPO also `approx_kl`, `clip_frac`).
      wall_time_s: seconds this call took; compile_time_s: of that, compiling the chunk.
      out_dir: where files went (None without `out_dir`).
      resumed_from: updates restored from a checkpoint (0 for a fresh run; equal to
        `config.num_updates` when a finished run was only loaded).
      policy: greedy `LearnedPolicy` (the jaxserve policy signature).
    """

    env_name: str
    env_overrides: dict[str, Any]
    algo: str
    config: TrainConfig
    env: Any
    env_params: Any
    network: nn.Module
    params: Any
    runner_state: RunnerState
    curves: dict[str, np.ndarray]
    wall_time_s: float
    compile_time_s: float
    out_dir: Path | None
    resumed_from: int = 0

    @property
    def policy(self) -> LearnedPolicy:
        """The greedy policy (argmax of the logits)."""
        return self.make_policy(greedy=True)

    def make_policy(self, greedy: bool = True) -> LearnedPolicy:
        """The trained actor as a jaxserve policy, greedy or sampling."""
        return LearnedPolicy(self.network, self.params, greedy,
                             self.algo + ("" if greedy else "-sampled"))

    def final_return(self, last: int = 10) -> float:
        """Mean of the last `last` finite per-update episode returns (NaN if there are none)."""
        r = self.curves["episode_return"]
        r = r[np.isfinite(r)]
        return float(r[-last:].mean()) if r.size else float("nan")


def chunk_size(num_updates: int, requested: int | None = None, target_chunks: int = 25) -> int:
    """Updates per jitted chunk: `requested`, else the largest divisor of `num_updates` that
    gives at least `target_chunks` chunks (one compiled chunk length for the whole run)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"chunk_updates must be >= 1, got {requested}")
        return min(int(requested), num_updates)
    cap = max(1, num_updates // target_chunks)
    return max(d for d in range(1, cap + 1) if num_updates % d == 0)


_TRAINERS: collections.OrderedDict = collections.OrderedDict()
_TRAINERS_MAX = 8


def _cached_trainer(env_name, overrides, algo, config, env, env_params, shard):
    """The trainer for this run, reused from an earlier `train` call of this process when the
    env, overrides, algorithm and config (up to the seed, which the program does not read)
    match, so repeated runs (seeds, resumes, notebooks) skip compiling."""
    ov = jsonable_overrides(overrides)
    key = None
    if not any(isinstance(v, dict) and set(v) == {"repr"} for v in ov.values()):
        key = (env_name, json.dumps(ov, sort_keys=True), algo,
               dataclasses.replace(config, seed=0), bool(shard))
    if key in _TRAINERS:
        _TRAINERS.move_to_end(key)
        env, env_params, trainer = _TRAINERS[key]
        return env, env_params, dataclasses.replace(trainer, config=config)
    trainer = ALGOS[algo][1](config, env, env_params)
    if shard:
        trainer = shard_trainer(trainer)
    if key is not None:
        _TRAINERS[key] = (env, env_params, trainer)
        while len(_TRAINERS) > _TRAINERS_MAX:
            _TRAINERS.popitem(last=False)
    return env, env_params, trainer


def _canonical_runner(runner: RunnerState, shard: bool) -> RunnerState:
    """`runner` typed and placed alike whether fresh or restored, so that one compiled chunk
    serves both: no weakly typed leaves (flax's `TrainState.step` starts as a Python 0, a
    checkpoint restores it as a strong int32), and unsharded, committed to the default device
    (restored arrays are). Without this a resumed run compiled its chunk again (measured
    4.8 s for a small Routing-v0 PPO on the 2-core CPU; a fresh run with the same config
    reused it). Values are unchanged."""
    def strong(x):
        return x.astype(x.dtype) if getattr(x, "weak_type", False) else x

    runner = jax.tree.map(strong, runner)
    if shard:
        return runner
    device = jax.config.jax_default_device  # a Device, a platform name, or None
    if not isinstance(device, jax.Device):
        device = jax.local_devices(backend=device)[0]
    return jax.device_put(runner, device)


def _compile_chunk(trainer: Trainer, runner: RunnerState, n: int):
    """AOT-compiles `train_chunk(., n)` when possible; returns `(fn(runner), seconds)`."""
    t0 = time.perf_counter()
    if hasattr(trainer.train_chunk, "lower"):
        compiled = trainer.train_chunk.lower(runner, n).compile()
        return compiled, time.perf_counter() - t0
    return (lambda rs: trainer.train_chunk(rs, n)), 0.0


def train(
    env_name: str,
    env_overrides: dict[str, Any] | None = None,
    algo: str = "ppo",
    total_steps: int | None = None,
    seed: int = 0,
    *,
    num_envs: int | None = None,
    progress: bool = True,
    out_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    chunk_updates: int | None = None,
    shard: bool = False,
    callback: Callable[[dict[str, Any]], Any] | None = None,
    imitate: str | None = None,
    **hparams: Any,
) -> TrainResult:
    """Trains `algo` on `env_name`, in jitted chunks with progress, metrics and checkpoints.

    Args:
      env_name: jaxserve id (Routing-v0, Batching-v0) or gymnax id (CartPole-v1, ...).
      env_overrides: environment overrides (see `make_env`), e.g. `{"arrival_rate": 2.5}`,
        applied over `ENV_DEFAULTS[env_name]["env_overrides"]` (the result records both).
      algo: "ppo" or "reinforce".
      total_steps: environment steps (rounded down to whole updates of
        `num_envs * num_steps`); None: the environment's default budget.
      seed: the run's seed: `jax.random.key(seed)` initialises envs, network and rollouts.
      num_envs: parallel environments (None: the environment's default).
      progress: show a tqdm bar (steps/s and the latest episode return).
      out_dir: directory for `metrics.csv`, `learning_curve.png` and `checkpoints/`; None
        writes nothing.
      checkpoint_every: also checkpoint every this many chunks (the end is always saved
        when `out_dir` is given).
      resume: continue from the newest checkpoint in `out_dir` (same env, overrides, algo and
        config required); bit-identical to an uninterrupted run.
      overwrite: delete an earlier run's checkpoints and metrics in `out_dir` first (without
        it, finding them is an error, so a run is never silently mixed with another).
      chunk_updates: updates per jitted chunk (default: about 25 chunks per run).
      shard: run data-parallel over all devices (`agents.sharding.shard_trainer`).
      callback: called after each chunk with `{"updates", "num_updates", "env_steps",
        "metrics" (this chunk's, numpy), "runner_state"}`; returning True stops training
        early (the result then holds the updates done).
      imitate: a registered heuristic of the environment's kind (e.g. "sita_predicted") to
        start from: before the first update the network is fitted to its decisions
        (`agents.imitation.imitate`, `imitation.DEFAULTS`; the heuristic fitted on a tuning
        key of `seed`). Recorded in the checkpoint; a resume must name the same one.
      **hparams: config fields (`lr`, `ent_coef`, `clip_eps`, `hidden_sizes`, `network`...).

    Returns:
      A `TrainResult` (params, greedy `policy`, learning curves, config, wall time).

    Raises:
      ValueError: unknown env/algo/hyperparameter, invalid value, an existing run in `out_dir`
        without `resume`/`overwrite`, or a corrupt or mismatched checkpoint on resume.
      FileNotFoundError: `resume=True` and no checkpoint in `out_dir`.
    """
    t_start = time.perf_counter()
    overrides = {**ENV_DEFAULTS.get(env_name, {}).get("env_overrides", {}),
                 **(env_overrides or {})}
    env, env_params = make_env(env_name, overrides)
    config = make_config(algo, env_name, env, total_steps, seed, num_envs, **hparams)
    env, env_params, trainer = _cached_trainer(env_name, overrides, algo, config, env,
                                               env_params, shard)
    num_updates = config.num_updates
    chunk = chunk_size(num_updates, chunk_updates)
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1 chunk, got {checkpoint_every}")
    key = jax.random.key(config.seed)
    main_process = jax.process_index() == 0
    teacher = None
    if imitate is not None:
        if shard:
            raise ValueError("imitate is not supported with shard=True yet")
        teacher = imitation.heuristic(env, env_params, imitate, config.seed)

    out = None if out_dir is None else Path(out_dir)
    ckpt_dir = None if out is None else (out / CHECKPOINT_DIR).absolute()
    ours = check_out_dir(out, resume=resume, overwrite=overwrite)

    wall_before = 0.0
    if resume:
        runner, done, curves, wall_before = _restore(ckpt_dir, trainer, key, env_name,
                                                     overrides, algo, imitate)
    else:
        if ours:  # with overwrite (check_out_dir refused it otherwise)
            shutil.rmtree(ckpt_dir)
        runner, done, curves = None, 0, {}
    if out is not None and main_process:
        out.mkdir(parents=True, exist_ok=True)
        if resume:
            _write_csv(out / METRICS_CSV, curves)  # drops rows past the checkpoint
        elif (out / METRICS_CSV).exists():
            (out / METRICS_CSV).unlink()

    show = progress and main_process
    if show:
        print(f"{algo} on {env_name}: {num_updates} updates of {config.batch_size} steps "
              f"({num_updates // chunk} chunks); compiling...", file=sys.stderr, flush=True)
    bar = None
    if runner is None:
        runner = trainer.init(key)
        if teacher is not None:
            if show:
                print(f"fitting the network to {imitate}'s decisions...", file=sys.stderr,
                      flush=True)
            runner = jax.jit(lambda r: imitation.warm_start(r, env, env_params, teacher,
                                                            config))(runner)
    runner = _canonical_runner(runner, shard)
    compile_s = 0.0
    run_chunk = None
    chunks_done = 0
    last_saved = done if resume else -1
    resumed_from = done
    last_return = _last_finite(curves.get("episode_return"))

    saving = False

    def save(step):
        nonlocal saving, last_saved
        saving = True
        meta = _metadata(env_name, overrides, algo, curves, wall_before
                         + time.perf_counter() - t_start, chunk, imitate)
        save_checkpoint(ckpt_dir, step, runner, config, meta, max_to_keep=3)
        saving, last_saved = False, step

    try:
        while done < num_updates:
            n = min(chunk, num_updates - done)
            if run_chunk is None:
                run_chunk, compile_s = _compile_chunk(trainer, runner, n)
                if show:
                    bar = tqdm(total=num_updates * config.batch_size,
                               initial=done * config.batch_size, unit="step", unit_scale=True,
                               dynamic_ncols=True, smoothing=0.3, desc=f"{algo} {env_name}",
                               file=sys.stderr)
            t_chunk = time.perf_counter()
            runner, metrics = run_chunk(runner)
            metrics = {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}
            sps = n * config.batch_size / max(time.perf_counter() - t_chunk, 1e-9)
            first = done
            done += n
            chunks_done += 1
            wall = wall_before + time.perf_counter() - t_start
            new = {"update": np.arange(first + 1, done + 1, dtype=np.float64),
                   "env_steps": np.arange(first + 1, done + 1, dtype=np.float64)
                   * config.batch_size,
                   "wall_time_s": np.full(n, wall)}
            new.update({k: v.astype(np.float64) for k, v in sorted(metrics.items())})
            curves = {k: np.concatenate([curves[k], v]) if k in curves else v
                      for k, v in new.items()}
            if out is not None and main_process:
                if first == 0:
                    _write_csv(out / METRICS_CSV, curves)
                else:
                    _write_csv(out / METRICS_CSV, curves, mode="a", start=first)
            last_return = _last_finite(metrics.get("episode_return"), last_return)
            if bar is not None:
                bar.update(n * config.batch_size)
                bar.set_postfix(ret=f"{last_return:.4g}", sps=f"{sps:.3g}", refresh=False)
            if (ckpt_dir is not None and checkpoint_every is not None
                    and chunks_done % checkpoint_every == 0 and done < num_updates):
                save(done)
            if callback is not None and callback({
                    "updates": done, "num_updates": num_updates,
                    "env_steps": done * config.batch_size, "metrics": metrics,
                    "runner_state": runner}) is True:
                break
    except KeyboardInterrupt:
        # `runner` is the state after the last finished chunk, so saving it is consistent.
        if bar is not None:
            bar.close()
            bar = None
        if ckpt_dir is not None and done > 0 and done != last_saved and not saving:
            save(done)
        raise
    finally:
        if bar is not None:
            bar.close()
    if ckpt_dir is not None and done != last_saved:
        save(done)
    if out is not None and main_process and done > 0:
        plot_learning_curve(curves, out / CURVE_PNG, f"{algo} on {env_name} (seed {seed})")
    runner = jax.block_until_ready(runner)
    return TrainResult(env_name, overrides, algo, config, env, env_params, trainer.network,
                       runner.train_state.params, runner, curves,
                       time.perf_counter() - t_start, compile_s, out, resumed_from)


def _last_finite(values, default: float = float("nan")) -> float:
    if values is None:
        return default
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    return float(v[-1]) if v.size else default
