"""PPO (clipped surrogate, GAE, minibatch epochs) as one XLA program, PureJaxRL style.

Example:
    env, env_params = gymnax.make("CartPole-v1")
    trainer = make_train(PPOConfig(total_timesteps=100_000), env, env_params)
    out = trainer(jax.random.key(0))      # or: rs = trainer.init(key)
    out.metrics["episode_return"]         #     rs, m = trainer.train_chunk(rs, 10)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.agents.config import PPOConfig
from jaxserve.agents.returns import gae, standardize
from jaxserve.agents.rollout import (
    RunnerState,
    Transition,
    categorical_entropy,
    categorical_log_prob,
    collect_rollout,
    episode_metrics,
)
from jaxserve.agents.sharding import constrain_batch
from jaxserve.agents.trainer import Metrics, Trainer, build_trainer


def ppo_loss(
    params: Any,
    apply_fn: Any,
    batch: Transition,
    advantages: jax.Array,
    targets: jax.Array,
    config: PPOConfig,
    hparams: dict[str, jax.Array] | None = None,
) -> tuple[jax.Array, Metrics]:
    """Clipped PPO objective on one minibatch.

    Args:
      params: network parameters.
      apply_fn: `apply_fn(params, obs (B, D)) -> (logits (B, A), value (B,))`.
      batch: minibatch of transitions, leaves `(B, ...)`.
      advantages: `(B,)` GAE advantages (standardised here if `config.normalize_advantages`).
      targets: `(B,)` value targets.
      config: PPO config (clip_value, vf_coef, normalize_advantages; clip_eps and ent_coef
        unless given in `hparams`).
      hparams: traced `{"clip_eps", "ent_coef"}` (`AgentState.hparams`); None reads the config.

    Returns:
      `(total_loss, aux)` with aux scalars total_loss, actor_loss, value_loss, entropy,
      approx_kl, clip_frac.
    """
    hp = {"clip_eps": config.clip_eps, "ent_coef": config.ent_coef, **(hparams or {})}
    clip_eps, ent_coef = hp["clip_eps"], hp["ent_coef"]
    logits, value = apply_fn(params, batch.obs)
    log_prob = categorical_log_prob(logits, batch.action)

    value_loss = jnp.square(value - targets)
    if config.clip_value:
        clipped = batch.value + jnp.clip(value - batch.value, -clip_eps, clip_eps)
        value_loss = jnp.maximum(value_loss, jnp.square(clipped - targets))
    value_loss = 0.5 * value_loss.mean()

    if config.normalize_advantages:
        advantages = standardize(advantages)
    log_ratio = log_prob - batch.log_prob
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    actor_loss = -jnp.minimum(ratio * advantages, clipped_ratio * advantages).mean()
    entropy = categorical_entropy(logits).mean()

    total = actor_loss + config.vf_coef * value_loss - ent_coef * entropy
    aux = {
        "total_loss": total,
        "actor_loss": actor_loss,
        "value_loss": value_loss,
        "entropy": entropy,
        "approx_kl": ((ratio - 1.0) - log_ratio).mean(),
        "clip_frac": (jnp.abs(ratio - 1.0) > clip_eps).mean(),
    }
    return total, aux


def make_update(config: PPOConfig, env: Any, env_params: Any):
    """Returns the pure PPO update `runner_state -> (runner_state, metrics)`.

    One update: a rollout of `num_steps` over `num_envs` envs, GAE, then `update_epochs`
    passes of `num_minibatches` shuffled minibatches. Metrics are scalars: episode metrics of
    the rollout (see `rollout.episode_metrics`) and losses averaged over all minibatches.
    """
    batch_size, num_mb = config.batch_size, config.num_minibatches

    def minibatch_step(train_state, minibatch):
        batch, adv, targets = minibatch
        grad_fn = jax.value_and_grad(ppo_loss, has_aux=True)
        (_, aux), grads = grad_fn(train_state.params, train_state.apply_fn, batch, adv, targets,
                                  config, train_state.hparams)
        return train_state.apply_gradients(grads=grads), aux

    def epoch(carry, _):
        train_state, key, data = carry
        key, k_perm = jax.random.split(key)
        perm = jax.random.permutation(k_perm, batch_size)
        minibatches = constrain_batch(jax.tree.map(
            lambda x: jnp.take(x, perm, axis=0).reshape((num_mb, -1) + x.shape[1:]), data
        ), axis=1)
        train_state, aux = jax.lax.scan(minibatch_step, train_state, minibatches)
        return (train_state, key, data), aux

    def update(runner: RunnerState) -> tuple[RunnerState, Metrics]:
        runner, traj = collect_rollout(runner, env, env_params, config.num_steps,
                                       config.gamma, config.discount_time_s)
        advantages, targets = gae(traj.reward, traj.value, traj.next_value, traj.terminated,
                                  traj.done, traj.discount, config.gae_lambda)
        flat = jax.tree.map(lambda x: x.reshape((batch_size,) + x.shape[2:]),
                            (traj, advantages, targets))
        key, k_epochs = jax.random.split(runner.key)
        (train_state, _, _), aux = jax.lax.scan(
            epoch, (runner.train_state, k_epochs, flat), None, config.update_epochs
        )
        metrics = {**episode_metrics(traj), **jax.tree.map(jnp.mean, aux)}
        return runner._replace(train_state=train_state, key=key), metrics

    return update


def make_train(
    config: PPOConfig, env: Any, env_params: Any, network: nn.Module | None = None
) -> Trainer:
    """Builds the PPO training loop.

    Args:
      config: PPO configuration.
      env: gymnax-1.0 environment with a discrete action space.
      env_params: its parameters (shared by all envs).
      network: actor-critic `(..., D) -> (logits (..., A), value (...))`; default
        `make_network(config, env.action_space(env_params).n)`.

    Returns:
      A `Trainer`: `trainer(key) -> TrainOutput`, plus `trainer.init(key)` and
      `trainer.train_chunk(runner_state, num_updates)`.
    """
    return build_trainer(config, env, env_params, network, make_update, PPOConfig)
