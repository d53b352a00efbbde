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
live in `ENV_DEFAULTS` (docs/training.md records how they were chosen); the environments are
the registered ones (only Autoscaling-v0 trains with environment overrides).
"""

from __future__ import annotations

import collections
import csv
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
import jax.numpy as jnp
import numpy as np

from agents import ppo, reinforce
from agents.checkpoint import latest_step, restore_checkpoint, save_checkpoint
from agents.config import PPOConfig, REINFORCEConfig, TrainConfig
from agents.rollout import RunnerState
from agents.trainer import Trainer

ALGOS: dict[str, tuple[type[TrainConfig], Callable[..., Trainer]]] = {
    "ppo": (PPOConfig, ppo.make_train),
    "reinforce": (REINFORCEConfig, reinforce.make_train),
}

# Tuned training defaults per environment, applied under the caller's values: per algorithm,
# hyperparameters (a "total_steps" entry is the default budget). Routing-v0 and Batching-v0
# train on the registered environment defaults (reward scale and shaping are the
# environment's, chosen so that a standard PPO learns: docs/training.md); only
# Autoscaling-v0 still has "env_overrides" (see there).
ENV_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "Routing-v0": {
        "ppo": dict(total_steps=500_000, num_envs=32, num_steps=32, lr=1e-3,
                    num_minibatches=4, update_epochs=8, gamma=0.99, gae_lambda=0.95,
                    ent_coef=0.01, hidden_sizes=(32, 32), set_mixer="mean"),
        "reinforce": dict(total_steps=1_000_000, num_envs=32, num_steps=16, lr=3e-3,
                          gamma=0.99, ent_coef=0.01, hidden_sizes=(32, 32), set_mixer="mean"),
    },
    # Batching-v0 is semi-Markov (a wait lasts one arrival gap, a dispatch until the GPU frees):
    # discount by simulated time, not per decision, or "always wait" looks cheap
    # (docs/training.md, "Batching-v0"). Its registered latency_scale (1000) keeps rewards O(1).
    "Batching-v0": {
        "ppo": dict(num_envs=32, num_steps=32, update_epochs=8, discount_time_s=5.0),
        "reinforce": dict(num_envs=32, num_steps=16, lr=3e-3, discount_time_s=5.0),
    },
    # Autoscaling-v0 trains with step actions (action_mode=1): a random policy then
    # random-walks the replica count instead of re-drawing it (and restarting warm-ups) every
    # 15 s; the baselines act by target through `action_for_target` in either mode. With the
    # registry's latency_scale (1000) value targets are ~-100 and the value-loss gradient
    # swamps the actor's after clipping (approx_kl ~1e-9); 10x keeps the actor learning.
    # These stay here, not in the registry, because the registered target action mode is what
    # the autoscaling baselines, tests and docs/scaling.md are written against.
    "Autoscaling-v0": {
        "env_overrides": dict(action_mode=1, latency_scale=10_000.0),
        "ppo": dict(total_steps=400_000, num_envs=32, num_steps=64, lr=3e-4, update_epochs=4),
        "reinforce": dict(total_steps=400_000, num_envs=32, num_steps=32, lr=1e-3),
    },
}

# Arguments of `train` that are not config hyperparameters.
_EXPLICIT = ("total_timesteps", "num_envs", "seed")

CHECKPOINT_DIR = "checkpoints"
METRICS_CSV = "metrics.csv"
CURVE_PNG = "learning_curve.png"


# ----------------------------------------------------------------------------- building blocks

def make_env(env_name: str, overrides: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """Builds a jaxserve or gymnax environment with parameter overrides.

    Args:
      env_name: a jaxserve id (`jaxserve.registered_envs()`) or a gymnax id
        (`gymnax.registered_envs`).
      overrides: jaxserve: keyword overrides of `jaxserve.make`; gymnax: fields of the env's
        `EnvParams` to replace.

    Returns:
      `(env, env_params)`.

    Raises:
      ValueError: unknown environment or override, or a non-discrete action space.
    """
    import gymnax

    import jaxserve

    overrides = dict(overrides or {})
    if env_name in jaxserve.registered_envs():
        env, params = jaxserve.make(env_name, **overrides)
    elif env_name in gymnax.registered_envs:
        env, params = gymnax.make(env_name)
        fields = {f.name for f in dataclasses.fields(params)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown {env_name} parameter(s) {unknown}; known: {sorted(fields)}")
        params = params.replace(**overrides)
    else:
        raise ValueError(f"unknown environment {env_name!r}; jaxserve: "
                         f"{', '.join(jaxserve.registered_envs())}; or a gymnax id such as "
                         f"CartPole-v1")
    if not hasattr(env.action_space(params), "n"):
        raise ValueError(f"{env_name} has a continuous action space; the agents need a discrete "
                         f"one")
    return env, params


def make_config(
    algo: str, env_name: str, env: Any, total_steps: int | None, seed: int,
    num_envs: int | None = None, **hparams: Any,
) -> TrainConfig:
    """The training config: config defaults < `ENV_DEFAULTS[env_name][algo]` < `hparams`.

    Environments with an `obs_layout` attribute (Routing-v0) default to `network="set"` with
    `set_dims=env.obs_layout`; the others to the MLP.

    Raises:
      ValueError: unknown algorithm or hyperparameter, or an invalid value (naming the field).
    """
    if algo not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r}; expected one of {sorted(ALGOS)}")
    cls = ALGOS[algo][0]
    explicit = sorted(set(hparams) & set(_EXPLICIT))
    if explicit:
        raise ValueError(f"pass {explicit} as train()'s own arguments (total_steps, num_envs, "
                         f"seed), not as hyperparameters")
    known = {f.name for f in dataclasses.fields(cls)} - set(_EXPLICIT)
    unknown = sorted(set(hparams) - known)
    if unknown:
        raise ValueError(f"unknown {algo} hyperparameter(s) {unknown}; known: {sorted(known)}")
    fields = dict(ENV_DEFAULTS.get(env_name, {}).get(algo, {}))
    default_steps = fields.pop("total_steps", cls.total_timesteps)
    if hasattr(env, "obs_layout") and hparams.get("network", "set") == "set":
        fields.setdefault("network", "set")
        fields["set_dims"] = tuple(env.obs_layout)
    fields.update(hparams)
    if num_envs is not None:
        fields["num_envs"] = num_envs
    total = default_steps if total_steps is None else total_steps
    return cls(total_timesteps=int(total), seed=int(seed), **fields)


@dataclasses.dataclass(frozen=True, eq=False)
class LearnedPolicy:
    """A trained actor as a jaxserve policy: `policy(key, obs, state, params) -> int32 action`.

    Greedy (argmax of the logits) by default, else sampled. Reads only `obs`; works on one
    observation or a batch. Hashes by identity, so it can be a static argument of `jax.jit`
    (as `jaxserve.evaluate_many` uses policies).

    Attributes:
      network: the actor-critic module; params: its parameters; greedy: argmax vs sample;
      name: a label for tables.
    """

    network: nn.Module
    params: Any
    greedy: bool = True
    name: str = "learned"

    def __call__(self, key, obs, state=None, params=None):
        logits, _ = self.network.apply(self.params, obs)
        if self.greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, logits).astype(jnp.int32)


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


def jsonable_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides as JSON: values JSON cannot hold are stored as `{"repr": repr(value)}`."""
    out = {}
    for k, v in sorted(overrides.items()):
        try:
            json.dumps(v, allow_nan=False)
            out[k] = v
        except (TypeError, ValueError):
            out[k] = {"repr": repr(v)}
    return json.loads(json.dumps(out))


# ----------------------------------------------------------------------------- files

def _curves_to_json(curves: dict[str, np.ndarray]) -> dict[str, list]:
    return {k: [None if not np.isfinite(x) else float(x) for x in np.asarray(v, np.float64)]
            for k, v in curves.items()}


def _curves_from_json(d: dict[str, list]) -> dict[str, np.ndarray]:
    return {k: np.array([np.nan if x is None else x for x in v], np.float64)
            for k, v in d.items()}


def _write_csv(path: Path, curves: dict[str, np.ndarray], mode: str = "w",
               start: int = 0) -> None:
    names = list(curves)
    with open(path, mode, newline="") as f:
        w = csv.writer(f)
        if mode == "w":
            w.writerow(names)
        for i in range(start, len(curves["update"])):
            w.writerow([_fmt(curves[k][i]) for k in names])


def _fmt(x: float) -> str:
    x = float(x)
    if not np.isfinite(x):
        return "nan"
    return str(int(x)) if x == int(x) and abs(x) < 2**53 else repr(x)


def plot_learning_curve(curves: dict[str, np.ndarray], path: str | os.PathLike,
                        title: str = "") -> None:
    """Episode return, losses and entropy against environment steps, saved as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = curves["env_steps"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    ret = curves["episode_return"]
    ok = np.isfinite(ret)
    axes[0].plot(steps[ok], ret[ok], lw=1.2)
    axes[0].set_ylabel("mean episode return")
    for name in ("actor_loss", "value_loss"):
        if name in curves:
            axes[1].plot(steps, curves[name], lw=1.0, label=name)
    axes[1].set_yscale("symlog", linthresh=1e-2)
    axes[1].legend()
    axes[1].set_ylabel("loss")
    axes[2].plot(steps, curves["entropy"], lw=1.0)
    axes[2].set_ylabel("policy entropy")
    for ax in axes:
        ax.set_xlabel("environment steps")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- training

def _metadata(env_name, overrides, algo, curves, wall, chunk):
    return {"env_name": env_name, "env_overrides": jsonable_overrides(overrides), "algo": algo,
            "curves": _curves_to_json(curves), "wall_time_s": wall, "chunk_updates": chunk}


def _restore(ckpt_dir: Path, trainer: Trainer, key, env_name, overrides, algo):
    if latest_step(ckpt_dir) is None:
        raise FileNotFoundError(f"resume=True but there is no checkpoint under {ckpt_dir}")
    template = jax.eval_shape(trainer.init, key)
    try:
        ckpt = restore_checkpoint(ckpt_dir, template)
    except ValueError as e:
        raise ValueError(f"cannot resume: {e}") from None
    meta = ckpt.metadata
    want = {"env_name": env_name, "env_overrides": jsonable_overrides(overrides), "algo": algo}
    got = {k: meta.get(k) for k in want}
    if got != want:
        raise ValueError(f"cannot resume: the checkpoint under {ckpt_dir} is of run {got}, "
                         f"not {want}")
    if ckpt.config != trainer.config:
        a, b = ckpt.config.to_dict(), trainer.config.to_dict()
        diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        raise ValueError(f"cannot resume: config differs from the checkpoint's "
                         f"(field: (saved, requested)): {diff}")
    if "curves" not in meta:
        raise ValueError(f"cannot resume: checkpoint under {ckpt_dir} has no learning curves "
                         f"(not written by agents.train)")
    curves = _curves_from_json(meta["curves"])
    if len(curves.get("update", [])) != ckpt.step:
        raise ValueError(f"cannot resume: checkpoint step {ckpt.step} does not match its "
                         f"{len(curves.get('update', []))} recorded updates")
    return (ckpt.runner_state, ckpt.step, curves,
            float(meta.get("wall_time_s", 0.0)))


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
        from agents.sharding import shard_trainer
        trainer = shard_trainer(trainer)
    if key is not None:
        _TRAINERS[key] = (env, env_params, trainer)
        while len(_TRAINERS) > _TRAINERS_MAX:
            _TRAINERS.popitem(last=False)
    return env, env_params, trainer


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

    out = None if out_dir is None else Path(out_dir)
    ckpt_dir = None if out is None else (out / CHECKPOINT_DIR).absolute()
    if resume and out is None:
        raise ValueError("resume=True needs out_dir (where the checkpoints are)")
    if resume and overwrite:
        raise ValueError("resume=True and overwrite=True contradict each other")

    wall_before = 0.0
    if resume:
        runner, done, curves, wall_before = _restore(ckpt_dir, trainer, key, env_name,
                                                     overrides, algo)
    else:
        if out is not None and ckpt_dir.exists() and latest_step(ckpt_dir) is not None:
            if not overwrite:
                raise ValueError(f"{out} already holds a training run; pass resume=True to "
                                 f"continue it or overwrite=True to replace it")
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
                         + time.perf_counter() - t_start, chunk)
        save_checkpoint(ckpt_dir, step, runner, config, meta, max_to_keep=3)
        saving, last_saved = False, step

    try:
        while done < num_updates:
            n = min(chunk, num_updates - done)
            if run_chunk is None:
                run_chunk, compile_s = _compile_chunk(trainer, runner, n)
                if show:
                    from tqdm import tqdm
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
