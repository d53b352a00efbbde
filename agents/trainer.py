"""The training-loop scaffolding shared by all agents: optimizer, initial state, chunked runs.

An agent supplies one pure `update(runner_state) -> (runner_state, metrics)`; `build_trainer`
wraps it into a `Trainer` with

* `init(key) -> RunnerState` (jitted),
* `train_chunk(runner_state, num_updates) -> (runner_state, metrics)` (jitted, `num_updates`
  static: a `lax.scan` of `update`), so callers can checkpoint between chunks,
* `trainer(key) -> TrainOutput`: `init` then one chunk of `config.num_updates` updates.

Running the updates in chunks gives bit-identical results to one chunk: all randomness lives
in `runner_state.key` and the learning-rate schedule reads the optimizer's step count.

Traced hyperparameters. The learning rate, the entropy coefficient and (PPO) the clip range
are arrays in the runner state, not constants of the compiled program, so one program can be
`vmap`ped over them (`scripts/sweep.py`): the learning rate is the injected hyperparameter of
the optimizer (`optax.inject_hyperparams`, in `opt_state.hyperparams["learning_rate"]`), the
loss coefficients live in `AgentState.hparams`. `init` fills them from the config;
`get_hparams` / `set_hparams` read and replace them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from jaxserve.agents.config import TrainConfig
from jaxserve.agents.networks import make_network
from jaxserve.agents.rollout import RunnerState, init_episode_stats

Metrics = dict[str, jax.Array]
UpdateFn = Callable[[RunnerState], tuple[RunnerState, Metrics]]


class TrainOutput(NamedTuple):
    """Result of a training run."""

    runner_state: RunnerState  # final state; params at runner_state.train_state.params
    metrics: Metrics  # each leaf (num_updates,) (per update)


class AgentState(TrainState):
    """`TrainState` plus the traced loss coefficients of the agent.

    Attributes (besides `TrainState`'s):
      hparams: `{name: float32 scalar}` for the names in `config.traced_loss_hparams`
        (`ent_coef`; PPO also `clip_eps`). Read by the losses instead of the config fields.
    """

    hparams: dict[str, jax.Array]


def _clipped_adam(
    learning_rate: jax.Array, *, max_grad_norm: float, anneal: bool, steps_per_update: int,
    num_updates: int,
) -> optax.GradientTransformation:
    if anneal:
        def lr(count: jax.Array) -> jax.Array:
            return learning_rate * (1.0 - (count // steps_per_update) / num_updates)
    else:
        lr = learning_rate
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(lr, eps=1e-5))


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping then Adam (eps 1e-5), the learning rate optionally annealed.

    With `anneal_lr` the rate falls linearly from `lr` to 0 over `config.num_updates` updates
    of `config.grad_steps_per_update` optimizer steps each (constant within an update). The
    base rate is an injected hyperparameter (`opt_state.hyperparams["learning_rate"]`, float32),
    initialised to `config.lr` and replaceable by `set_hparams`.
    """
    factory = optax.inject_hyperparams(
        _clipped_adam, static_args=("max_grad_norm", "anneal", "steps_per_update", "num_updates")
    )
    return factory(learning_rate=jnp.float32(config.lr), max_grad_norm=config.max_grad_norm,
                   anneal=config.anneal_lr, steps_per_update=config.grad_steps_per_update,
                   num_updates=config.num_updates)


def traced_hparam_names(config: TrainConfig) -> tuple[str, ...]:
    """Hyperparameters of `config` that are runtime arrays: "lr" plus the loss coefficients."""
    return ("lr",) + tuple(config.traced_loss_hparams)


def get_hparams(train_state: AgentState) -> dict[str, jax.Array]:
    """The traced hyperparameters of a train state: `{"lr", "ent_coef", ...}` float32 scalars."""
    return {"lr": train_state.opt_state.hyperparams["learning_rate"], **train_state.hparams}


def set_hparams(runner_state: RunnerState, **values: Any) -> RunnerState:
    """Replaces traced hyperparameters (see `get_hparams`); works on traced values (vmap).

    Args:
      runner_state: a runner state from `Trainer.init`.
      **values: new values, e.g. `lr=3e-4, ent_coef=0.0`; cast to float32 scalars.

    Returns:
      The runner state with those hyperparameters replaced.

    Raises:
      ValueError: a name that is not a traced hyperparameter of this agent.
    """
    ts = runner_state.train_state
    known = ("lr",) + tuple(ts.hparams)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"not traced hyperparameters: {unknown}; traced: {list(known)}")
    cast = {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}
    opt_state = ts.opt_state
    if "lr" in cast:
        opt_state = opt_state._replace(
            hyperparams={**opt_state.hyperparams, "learning_rate": cast.pop("lr")})
    ts = ts.replace(opt_state=opt_state, hparams={**ts.hparams, **cast})
    return runner_state._replace(train_state=ts)


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
    hparams = {name: jnp.float32(getattr(config, name)) for name in config.traced_loss_hparams}
    train_state = AgentState.create(apply_fn=network.apply, params=params, tx=tx,
                                    hparams=hparams)
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
