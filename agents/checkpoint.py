"""Save and restore training runs (runner state + config + metadata) with orbax-checkpoint.

Layout: an `ocp.CheckpointManager` directory with one sub-directory per step, each holding the
items `state` (the `RunnerState` arrays, `StandardSave`), `config` (`TrainConfig.to_dict()`,
JSON) and `metadata` (any JSON-serialisable dict). Typed PRNG keys are stored as their raw
key data and re-wrapped on restore. Zero-size arrays (e.g. the empty request log of a
jaxserve environment built without one), which orbax refuses to save, are stored as nothing
and rebuilt from the template's shapes on restore. Restoring and continuing with `Trainer.train_chunk` gives
bit-identical results to an uninterrupted run.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxserve.agents.config import TrainConfig, config_from_dict
from jaxserve.agents.rollout import RunnerState

_ITEMS = ("state", "config", "metadata")


class Checkpoint(NamedTuple):
    """A restored checkpoint."""

    runner_state: RunnerState
    config: TrainConfig
    metadata: dict[str, Any]
    step: int


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_impl(key: Any) -> Any:
    # Concrete keys know their implementation; abstract ones (jax.eval_shape) carry it on the
    # dtype only privately, so fall back to the default implementation there.
    return jax.random.key_impl(key) if isinstance(key, jax.Array) else None


def _keys_to_data(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _drop_empty(tree: Any) -> Any:
    # Zero-size leaves hold no data; orbax cannot save them, so they become None (no leaf).
    return jax.tree.map(lambda x: None if x.size == 0 else x, tree)


def _refill_empty(template: Any, restored: Any) -> Any:
    # The inverse of `_drop_empty`: zero-size leaves come back from the template's shapes.
    is_leaf = lambda x: x is None  # noqa: E731
    return jax.tree.map(
        lambda t, r: r if t is None else (jnp.zeros(t.shape, t.dtype) if t.size == 0 else r),
        template, restored, is_leaf=is_leaf)


def _manager(directory: str, max_to_keep: int | None = None) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(directory, options=options, item_names=_ITEMS)


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    runner_state: RunnerState,
    config: TrainConfig,
    metadata: dict[str, Any] | None = None,
    max_to_keep: int | None = None,
) -> str:
    """Writes a checkpoint for `step` under `directory` (created if missing) and waits for it.

    Args:
      directory: checkpoint root; one sub-directory per step.
      step: step label, e.g. the number of updates done so far.
      runner_state: state to save (arrays only; the apply_fn/tx of the TrainState are not).
      config: the training config, saved as JSON.
      metadata: extra JSON-serialisable information (env id, wall time, metrics...).
      max_to_keep: keep only the newest `max_to_keep` steps (None keeps all).

    Returns:
      The path of the step's checkpoint directory.

    Raises:
      orbax.checkpoint's StepAlreadyExistsError: `step` is already saved under `directory`.
    """
    directory = os.path.abspath(os.fspath(directory))
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(_drop_empty(_keys_to_data(runner_state))),
        config=ocp.args.JsonSave(config.to_dict()),
        metadata=ocp.args.JsonSave(dict(metadata or {})),
    )
    with _manager(directory, max_to_keep) as manager:
        manager.save(int(step), args=args, force=True)
        manager.wait_until_finished()
    return os.path.join(directory, str(int(step)))


def latest_step(directory: str | os.PathLike) -> int | None:
    """Newest saved step under `directory`, or None if there is none."""
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        return None
    with _manager(directory) as manager:
        return manager.latest_step()


def restore_checkpoint(
    directory: str | os.PathLike, template: RunnerState, step: int | None = None
) -> Checkpoint:
    """Restores a checkpoint written by `save_checkpoint`.

    Args:
      directory: checkpoint root given to `save_checkpoint`.
      template: a `RunnerState` with the right structure, e.g. `trainer.init(key)` or
        `jax.eval_shape(trainer.init, key)`; its TrainState supplies `apply_fn` and `tx`, its
        PRNG key leaves the key implementation.
      step: step to restore; None restores the newest.

    Returns:
      The `Checkpoint` (runner_state, config, metadata, step).

    Raises:
      FileNotFoundError: no checkpoint (or not that step) under `directory`.
      ValueError: the checkpoint is unreadable, corrupt or does not match `template`.
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no checkpoint directory at {directory}")
    with _manager(directory) as manager:
        steps = manager.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint steps found in {directory}")
            step = max(steps)
        elif step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {directory} (has {steps})")
        path = os.path.join(directory, str(step))
        abstract = _drop_empty(jax.eval_shape(_keys_to_data, template))
        try:
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract),
                config=ocp.args.JsonRestore(),
                metadata=ocp.args.JsonRestore(),
            ))
            config = config_from_dict(restored["config"])
        except Exception as e:  # orbax raises many types for a damaged checkpoint.
            raise ValueError(f"could not restore checkpoint at {path}: {e}") from e
    state = _refill_empty(jax.eval_shape(_keys_to_data, template), restored["state"])
    runner_state = jax.tree.map(
        lambda t, x: jax.random.wrap_key_data(x, impl=_key_impl(t)) if _is_key(t) else x,
        template, state,
    )
    return Checkpoint(runner_state, config, dict(restored["metadata"] or {}), int(step))
