"""The training-loop scaffolding shared by all agents: optimizer, initial state, chunked runs.

An agent supplies one pure `update(runner_state) -> (runner_state, metrics)`; `build_trainer`
wraps it into a `Trainer` with

* `init(key) -> RunnerState` (jitted),
* `train_chunk(runner_state, num_updates) -> (runner_state, metrics)` (jitted, `num_updates`
  static: a `lax.scan` of `update`), so callers can checkpoint between chunks,
* `trainer(key) -> TrainOutput`: `init` then one chunk of `config.num_updates` updates.

Running the updates in chunks gives bit-identical results to one chunk: all randomness lives
in `runner_state.key` and the learning-rate schedule reads the optimizer's step count.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import optax
from flax.training.train_state import TrainState

from agents.config import TrainConfig
from agents.networks import make_network
from agents.rollout import RunnerState, init_episode_stats

Metrics = dict[str, jax.Array]
UpdateFn = Callable[[RunnerState], tuple[RunnerState, Metrics]]


class TrainOutput(NamedTuple):
    """Result of a training run."""

    runner_state: RunnerState  # final state; params at runner_state.train_state.params
    metrics: Metrics  # each leaf (num_updates,) (per update)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping then Adam (eps 1e-5), the learning rate optionally annealed.

    With `anneal_lr` the rate falls linearly from `lr` to 0 over `config.num_updates` updates
    of `config.grad_steps_per_update` optimizer steps each (constant within an update).
    """
    steps_per_update = config.grad_steps_per_update
    num_updates = config.num_updates

    def schedule(count: jax.Array) -> jax.Array:
        frac = 1.0 - (count // steps_per_update) / num_updates
        return config.lr * frac

    lr = schedule if config.anneal_lr else config.lr
    return optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr, eps=1e-5)
    )


def init_runner_state(
    key: jax.Array,
    config: TrainConfig,
    env: Any,
    env_params: Any,
    network: nn.Module,
    tx: optax.GradientTransformation,
) -> RunnerState:
    """Resets `config.num_envs` envs and initialises the network and optimizer.

    Args:
      key: PRNG key (raw `PRNGKey` or typed `jax.random.key`).
      config: training config (uses num_envs).
      env: gymnax environment; env_params: its parameters.
      network: actor-critic module; tx: optimizer.

    Returns:
      The initial `RunnerState`.
    """
    key, k_net, k_env = jax.random.split(key, 3)
    reset_keys = jax.random.split(k_env, config.num_envs)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(reset_keys, env_params)
    params = network.init(k_net, obs[:1])
    train_state = TrainState.create(apply_fn=network.apply, params=params, tx=tx)
    return RunnerState(train_state, env_state, obs, init_episode_stats(config.num_envs), key)


def run_updates(
    update: UpdateFn, runner_state: RunnerState, num_updates: int
) -> tuple[RunnerState, Metrics]:
    """`num_updates` applications of `update` in one `lax.scan` (not jitted itself).

    Returns:
      `(runner_state, metrics)` with metrics leaves `(num_updates, ...)`.
    """
    return jax.lax.scan(lambda rs, _: update(rs), runner_state, None, num_updates)


@dataclasses.dataclass(frozen=True)
class Trainer:
    """A compiled training loop. Call it with a key to train for `config.num_updates` updates.

    Attributes:
      config: the training config.
      env, env_params: the environment and its parameters.
      network: the actor-critic module.
      update: one pure update step (rollout + learning), for custom loops (e.g. sharding).
      init: jitted `init(key) -> RunnerState`.
      train_chunk: jitted `train_chunk(runner_state, num_updates) -> (runner_state, metrics)`,
        `num_updates` static (a positional int).
    """

    config: TrainConfig
    env: Any
    env_params: Any
    network: nn.Module
    update: UpdateFn
    init: Callable[[jax.Array], RunnerState]
    train_chunk: Callable[[RunnerState, int], tuple[RunnerState, Metrics]]

    @property
    def num_updates(self) -> int:
        """Updates in a full run (`config.num_updates`)."""
        return self.config.num_updates

    def __call__(self, key: jax.Array) -> TrainOutput:
        """Trains from scratch: `train_chunk(init(key), num_updates)`."""
        return TrainOutput(*self.train_chunk(self.init(key), self.num_updates))


def build_trainer(
    config: TrainConfig,
    env: Any,
    env_params: Any,
    network: nn.Module | None,
    make_update: Callable[[Any, Any, Any], UpdateFn],
    config_type: type[TrainConfig],
) -> Trainer:
    """Assembles a `Trainer` from an agent's update factory (used by each agent's make_train).

    Args:
      config: training config; must be a `config_type`.
      env, env_params: gymnax environment and parameters.
      network: actor-critic module, or None for `make_network(config, num_actions)`.
      make_update: `make_update(config, env, env_params) -> update`, the agent's pure update.
      config_type: the config class the agent expects.

    Returns:
      The `Trainer`.

    Raises:
      ValueError: `config` is not a `config_type`.
    """
    if not isinstance(config, config_type):
        raise ValueError(f"expected a {config_type.__name__}, got {type(config).__name__}")
    if network is None:
        network = make_network(config, int(env.action_space(env_params).n))
    tx = make_optimizer(config)
    init = jax.jit(functools.partial(
        init_runner_state, config=config, env=env, env_params=env_params, network=network, tx=tx
    ))
    update = make_update(config, env, env_params)
    train_chunk = jax.jit(functools.partial(run_updates, update), static_argnums=1)
    return Trainer(config, env, env_params, network, update, init, train_chunk)
