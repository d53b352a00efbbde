"""Rollout collection over vmapped gymnax envs, episode statistics and categorical helpers.

Shared by `agents.ppo` and `agents.reinforce`. Shapes: E = `num_envs`, T = `num_steps`,
D = observation size, A = number of actions.

Truncation is not termination: `next_value` is the critic on `info["final_observation"]`
(the observation before the auto-reset), so the return of a truncated episode is bootstrapped
from the state where the time limit cut it, and the return of the last step of a rollout from
the state it stopped in. Where no episode ended that observation is the next step's, whose
value the next step computes anyway: the extra critic pass runs only at steps where some
environment's episode ended (serving envs truncate all their environments at the same few
steps, so most rollouts need one pass per step, not two).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax.training.train_state import TrainState

from jaxserve.core.lanes import batch_max

# RunnerState fields whose leading axis is the environment batch (E); the rest is replicated.
ENV_BATCHED_FIELDS = ("env_state", "obs", "episode_stats")


class EpisodeStats(NamedTuple):
    """Running return and length of the current episode of each env."""

    episode_return: jax.Array  # (E,) float32
    episode_length: jax.Array  # (E,) int32


class RunnerState(NamedTuple):
    """Everything a training loop carries from one update to the next."""

    train_state: TrainState  # params, optimizer state, step (replicated)
    env_state: Any  # env state pytree, leaves (E, ...)
    obs: jax.Array  # (E, D)
    episode_stats: EpisodeStats  # leaves (E,)
    key: jax.Array  # PRNG key (replicated)


class Transition(NamedTuple):
    """One rollout; every leaf has leading axes (T, E)."""

    obs: jax.Array  # (T, E, D) observation the action was taken in
    action: jax.Array  # (T, E) int32
    log_prob: jax.Array  # (T, E) float32, behaviour policy
    value: jax.Array  # (T, E) float32, V(obs)
    next_value: jax.Array  # (T, E) float32, V(final_observation), pre-reset
    reward: jax.Array  # (T, E) float32
    discount: jax.Array  # (T, E) float32, discount applied to what follows this step
    terminated: jax.Array  # (T, E) bool, natural end: no bootstrap
    done: jax.Array  # (T, E) bool, terminated or truncated: the episode ended here
    episode_return: jax.Array  # (T, E) float32, return of the episode ended here, else 0
    episode_length: jax.Array  # (T, E) int32, length of the episode ended here, else 0


def categorical_log_prob(logits: jax.Array, action: jax.Array) -> jax.Array:
    """Log-probability of `action (...)` under `logits (..., A)`. Returns `(...)`."""
    log_p = jax.nn.log_softmax(logits)
    return jnp.take_along_axis(log_p, action[..., None].astype(jnp.int32), axis=-1)[..., 0]


def categorical_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of the categorical with `logits (..., A)`. Returns `(...)`."""
    log_p = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def init_episode_stats(num_envs: int) -> EpisodeStats:
    """Zero running statistics for `num_envs` envs."""
    return EpisodeStats(jnp.zeros((num_envs,), jnp.float32), jnp.zeros((num_envs,), jnp.int32))


def update_episode_stats(
    stats: EpisodeStats, reward: jax.Array, done: jax.Array
) -> tuple[EpisodeStats, jax.Array, jax.Array]:
    """Adds one step to the running statistics and closes finished episodes.

    Args:
      stats: running statistics, leaves `(E,)`.
      reward: `(E,)` reward of this step.
      done: `(E,)` bool, the episode ended at this step (terminated or truncated).

    Returns:
      `(stats, completed_return (E,), completed_length (E,))`; the completed values are the
      finished episode's return/length where `done`, else 0. Finished envs restart at 0.
    """
    ret = stats.episode_return + reward.astype(jnp.float32)
    length = stats.episode_length + jnp.int32(1)
    completed_return = jnp.where(done, ret, jnp.float32(0.0))
    completed_length = jnp.where(done, length, jnp.int32(0))
    new = EpisodeStats(jnp.where(done, jnp.float32(0.0), ret),
                       jnp.where(done, jnp.int32(0), length))
    return new, completed_return, completed_length


def episode_metrics(traj: Transition) -> dict[str, jax.Array]:
    """Mean return/length of the episodes completed during a rollout.

    Returns:
      `{"episode_return", "episode_length"}` float32 scalars (NaN when no episode finished)
      and `"num_episodes"` int32.
    """
    count = traj.done.sum(dtype=jnp.int32)
    safe = jnp.maximum(count, 1).astype(jnp.float32)
    nan = jnp.float32(jnp.nan)
    return {
        "episode_return": jnp.where(count > 0, traj.episode_return.sum() / safe, nan),
        "episode_length": jnp.where(count > 0, traj.episode_length.sum() / safe, nan),
        "num_episodes": count,
    }


def step_discount(gamma: float, discount_time_s: float | None, info: dict) -> jax.Array:
    """Discount between a step and the next: `gamma`, or `gamma ** (elapsed / discount_time_s)`.

    Raises:
      ValueError: `discount_time_s` is set but the env reports no `info["elapsed"]`.
    """
    if discount_time_s is None:
        return jnp.float32(gamma)
    if "elapsed" not in info:
        raise ValueError("discount_time_s needs an environment that reports info['elapsed'] "
                         "(simulated seconds per step); this one does not")
    elapsed = jnp.maximum(info["elapsed"].astype(jnp.float32), 0.0)
    # A step that took no simulated time does not discount (and avoids 0 ** 0 with gamma 0).
    return jnp.where(elapsed > 0, jnp.float32(gamma) ** (elapsed / discount_time_s), 1.0)


def collect_rollout(
    runner: RunnerState, env: Any, env_params: Any, num_steps: int,
    gamma: float = 0.99, discount_time_s: float | None = None,
) -> tuple[RunnerState, Transition]:
    """Steps all envs `num_steps` times with the current policy (a `lax.scan`).

    Args:
      runner: current runner state; its key is split and advanced.
      env: a gymnax-1.0 environment (auto-resetting `step`, `info["final_observation"]`).
      env_params: env parameters, shared by all envs.
      num_steps: rollout length T (static).
      gamma: discount factor; with `discount_time_s` it sets each transition's `discount`
        (see `step_discount`).
      discount_time_s: see `gamma` and `step_discount`.

    Returns:
      `(runner, traj)`: the runner state after the rollout (train_state unchanged) and the
      `Transition` with leaves `(T, E, ...)`.
    """
    train_state = runner.train_state
    apply_fn, params = train_state.apply_fn, train_state.params
    num_envs = runner.obs.shape[0]
    vmapped_step = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    def step(carry, _):
        env_state, obs, stats, key = carry
        key, k_act, k_env = jax.random.split(key, 3)
        logits, value = apply_fn(params, obs)
        action = jax.random.categorical(k_act, logits).astype(jnp.int32)
        log_prob = categorical_log_prob(logits, action)
        next_obs, env_state, reward, terminated, truncated, info = vmapped_step(
            jax.random.split(k_env, num_envs), env_state, action, env_params
        )
        done = jnp.logical_or(terminated, truncated)
        # V(final_observation) where an episode ended; elsewhere it is V(next_obs), which the
        # next step computes (filled in after the scan). One conditional for the whole batch,
        # under vmap over seeds too (`batch_max`).
        end_value = jax.lax.cond(batch_max(done.any()),
                                 lambda: apply_fn(params, info["final_observation"])[1],
                                 lambda: jnp.zeros_like(value))
        reward = reward.astype(jnp.float32)
        discount = jnp.broadcast_to(step_discount(gamma, discount_time_s, info), reward.shape)
        stats, ep_return, ep_length = update_episode_stats(stats, reward, done)
        transition = Transition(obs, action, log_prob, value, end_value, reward, discount,
                                terminated.astype(bool), done, ep_return, ep_length)
        return (env_state, next_obs, stats, key), transition

    carry = (runner.env_state, runner.obs, runner.episode_stats, runner.key)
    (env_state, obs, stats, key), traj = jax.lax.scan(step, carry, None, num_steps)
    _, last_value = apply_fn(params, obs)
    following = jnp.concatenate([traj.value[1:], last_value[None]], 0)
    traj = traj._replace(next_value=jnp.where(traj.done, traj.next_value, following))
    return RunnerState(train_state, env_state, obs, stats, key), traj
