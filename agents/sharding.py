"""Data-parallel training: the environment batch is sharded across devices, params replicated.

The env-batched fields of `RunnerState` (`rollout.ENV_BATCHED_FIELDS`: env_state, obs,
episode_stats; leading axis E) get `NamedSharding(mesh, P("data"))`; the train state and the
key are replicated. `init` and `train_chunk` are jitted with those shardings and XLA's SPMD
partitioner does the rest: each device steps E / num_devices envs, and because the losses are
means over the sharded batch the gradients are averaged across devices automatically.
Results match a single-device run up to float reduction order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.agents.rollout import ENV_BATCHED_FIELDS, RunnerState
from jaxserve.agents.trainer import Trainer, run_updates

AXIS = "data"


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with axis "data" over `devices` (default: all of `jax.devices()`)."""
    devices = list(jax.devices() if devices is None else devices)
    return Mesh(np.array(devices), (AXIS,))


def runner_state_shardings(runner_state: RunnerState, mesh: Mesh) -> RunnerState:
    """Shardings for each leaf of `runner_state` (concrete or `jax.eval_shape` abstract).

    Returns:
      A `RunnerState`-structured pytree of `NamedSharding`: `P("data")` on env-batched fields,
      `P()` (replicated) elsewhere.
    """
    data = NamedSharding(mesh, PartitionSpec(AXIS))
    replicated = NamedSharding(mesh, PartitionSpec())
    return RunnerState(**{
        name: jax.tree.map(lambda _, s=(data if name in ENV_BATCHED_FIELDS else replicated): s,
                           getattr(runner_state, name))
        for name in RunnerState._fields
    })


def shard_runner_state(runner_state: RunnerState, mesh: Mesh) -> RunnerState:
    """Places `runner_state` on `mesh` (env batch split over "data", the rest replicated)."""
    _check_divisible(runner_state.obs.shape[0], mesh)
    return jax.device_put(runner_state, runner_state_shardings(runner_state, mesh))


def shard_trainer(trainer: Trainer, mesh: Mesh | None = None) -> Trainer:
    """A copy of `trainer` whose `init` and `train_chunk` run data-parallel on `mesh`.

    Args:
      trainer: a `Trainer` from `ppo.make_train` or `reinforce.make_train`.
      mesh: a 1-D mesh with axis "data" (default `make_mesh()`); `config.num_envs` must be
        divisible by its size.

    Returns:
      A `Trainer` with the same config, network and update; `init(key)` returns a sharded
      runner state and `train_chunk(runner_state, num_updates)` keeps it sharded (metrics
      replicated). A runner state from elsewhere (e.g. a restored checkpoint) is resharded
      on entry.

    Raises:
      ValueError: `num_envs` is not divisible by the number of devices.
    """
    mesh = make_mesh() if mesh is None else mesh
    _check_divisible(trainer.config.num_envs, mesh)
    template = jax.eval_shape(trainer.init, jax.random.key(0))
    shardings = runner_state_shardings(template, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    init = jax.jit(trainer.init, out_shardings=shardings)
    chunk = jax.jit(
        functools.partial(run_updates, trainer.update),
        static_argnums=1,
        in_shardings=(shardings,),
        out_shardings=(shardings, replicated),
    )

    def train_chunk(runner_state: RunnerState, num_updates: int):
        runner_state = jax.device_put(runner_state, shardings)  # no-op if already placed
        with jax.set_mesh(mesh):  # lets `constrain_batch` see the mesh while tracing
            return chunk(runner_state, num_updates)

    return dataclasses.replace(trainer, init=init, train_chunk=train_chunk)


def constrain_batch(tree: Any, axis: int = 0) -> Any:
    """Shards `axis` of every leaf over mesh axis "data" when traced under such a mesh.

    Used inside update functions to keep the learning phase data-parallel (each device
    computes the gradient of its slice of a minibatch; XLA all-reduces). Outside a mesh context
    with a "data" axis (single-device runs) it is the identity.

    Args:
      tree: pytree of arrays whose `axis` has a size divisible by the number of devices.
      axis: the batch axis to shard.

    Returns:
      `tree`, with sharding constraints attached.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names:
        return tree
    spec = PartitionSpec(*([None] * axis + [AXIS]))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, spec), tree)


def _check_divisible(num_envs: int, mesh: Mesh) -> None:
    if num_envs % mesh.size:
        raise ValueError(
            f"num_envs={num_envs} must be divisible by the number of devices ({mesh.size}) "
            f"to shard the environment batch"
        )
