"""REINFORCE with a learned value baseline, same shape as `agents.ppo`.

Each update collects a rollout and takes one full-batch gradient step on

    -mean(log pi(a_t | s_t) * A_t) + vf_coef * 0.5 * mean((V(s_t) - G_t)^2) - ent_coef * H

where `G_t` is the Monte Carlo return within the rollout, cut at episode ends and
bootstrapped with the critic at truncations (`V(final_observation)`) and at the rollout end,
and `A_t = G_t - V(s_t)` (optionally standardised). `G_t` is `gae(..., gae_lambda=1)`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.agents.config import REINFORCEConfig
from jaxserve.agents.returns import gae, standardize
from jaxserve.agents.rollout import (
    RunnerState,
    Transition,
    categorical_entropy,
    categorical_log_prob,
    collect_rollout,
    episode_metrics,
)
from jaxserve.agents.trainer import Metrics, Trainer, build_trainer


def reinforce_loss(
    params: Any, apply_fn: Any, traj: Transition, returns: jax.Array, config: REINFORCEConfig,
    hparams: dict[str, jax.Array] | None = None,
) -> tuple[jax.Array, Metrics]:
    """Policy-gradient loss with a value baseline on a whole rollout.

    Args:
      params: network parameters.
      apply_fn: `apply_fn(params, obs (..., D)) -> (logits (..., A), value (...))`.
      traj: rollout, leaves `(T, E, ...)`.
      returns: `(T, E)` bootstrapped Monte Carlo returns.
      config: REINFORCE config (vf_coef, normalize_advantages; ent_coef unless in `hparams`).
      hparams: traced `{"ent_coef"}` (`AgentState.hparams`); None reads the config.

    Returns:
      `(total_loss, aux)` with aux scalars total_loss, actor_loss, value_loss, entropy.
    """
    logits, value = apply_fn(params, traj.obs)
    log_prob = categorical_log_prob(logits, traj.action)
    advantages = jax.lax.stop_gradient(returns - value)
    if config.normalize_advantages:
        advantages = standardize(advantages)
    actor_loss = -(log_prob * advantages).mean()
    value_loss = 0.5 * jnp.square(value - returns).mean()
    entropy = categorical_entropy(logits).mean()
    ent_coef = (hparams or {}).get("ent_coef", config.ent_coef)
    total = actor_loss + config.vf_coef * value_loss - ent_coef * entropy
    aux = {"total_loss": total, "actor_loss": actor_loss, "value_loss": value_loss,
           "entropy": entropy}
    return total, aux


def make_update(config: REINFORCEConfig, env: Any, env_params: Any):
    """Returns the pure REINFORCE update `runner_state -> (runner_state, metrics)`."""

    def update(runner: RunnerState) -> tuple[RunnerState, Metrics]:
        runner, traj = collect_rollout(runner, env, env_params, config.num_steps,
                                       config.gamma, config.discount_time_s)
        _, returns = gae(traj.reward, traj.value, traj.next_value, traj.terminated, traj.done,
                         traj.discount, 1.0)
        train_state = runner.train_state
        grad_fn = jax.value_and_grad(reinforce_loss, has_aux=True)
        (_, aux), grads = grad_fn(train_state.params, train_state.apply_fn, traj, returns, config,
                                  train_state.hparams)
        train_state = train_state.apply_gradients(grads=grads)
        return runner._replace(train_state=train_state), {**episode_metrics(traj), **aux}

    return update


def make_train(
    config: REINFORCEConfig, env: Any, env_params: Any, network: nn.Module | None = None
) -> Trainer:
    """Builds the REINFORCE training loop.

    Args:
      config: REINFORCE configuration.
      env: gymnax-1.0 environment with a discrete action space.
      env_params: its parameters (shared by all envs).
      network: actor-critic `(..., D) -> (logits (..., A), value (...))`; default
        `make_network(config, env.action_space(env_params).n)`.

    Returns:
      A `Trainer`: `trainer(key) -> TrainOutput`, plus `trainer.init(key)` and
      `trainer.train_chunk(runner_state, num_updates)`.
    """
    return build_trainer(config, env, env_params, network, make_update, REINFORCEConfig)
