"""Advantage and return estimators with truncation-aware bootstrapping.

`gae` with `gae_lambda=1` gives Monte Carlo returns over the rollout, bootstrapped at the
rollout end and at truncations, which is what REINFORCE uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gae(
    rewards: jax.Array,
    values: jax.Array,
    next_values: jax.Array,
    terminated: jax.Array,
    dones: jax.Array,
    gamma: float | jax.Array,
    gae_lambda: float,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over a rollout, time-major.

    The TD error bootstraps from the value of the pre-reset observation unless the episode
    terminated naturally; the recursion stops at every episode end (terminated or truncated):

        delta_t = r_t + gamma_t * (1 - terminated_t) * next_value_t - value_t
        A_t     = delta_t + gamma_t * lambda * (1 - done_t) * A_{t+1},   A_T = 0

    For the last step of the rollout `next_value` is the value of the state it stopped in, so
    no separate bootstrap value is needed.

    Args:
      rewards: `(T, ...)` float rewards.
      values: `(T, ...)` V(obs_t).
      next_values: `(T, ...)` V(final_observation_t), the observation before any auto-reset.
      terminated: `(T, ...)` bool, natural termination (no bootstrap).
      dones: `(T, ...)` bool, terminated or truncated (episode boundary).
      gamma: discount: a scalar, or `(T, ...)` per-step discounts (semi-Markov envs, where
        `gamma_t` discounts what follows step t by the simulated time it took).
      gae_lambda: GAE lambda; 1 gives bootstrapped Monte Carlo returns.

    Returns:
      `(advantages, targets)`, both `(T, ...)` float32, with `targets = advantages + values`.
    """
    rewards, values, next_values = (x.astype(jnp.float32) for x in (rewards, values, next_values))
    not_terminated = 1.0 - terminated.astype(jnp.float32)
    not_done = 1.0 - dones.astype(jnp.float32)
    gammas = jnp.broadcast_to(jnp.asarray(gamma, jnp.float32), rewards.shape)
    deltas = rewards + gammas * not_terminated * next_values - values

    def backward(next_adv, x):
        delta, cont, g = x
        adv = delta + g * gae_lambda * cont * next_adv
        return adv, adv

    _, advantages = jax.lax.scan(
        backward, jnp.zeros_like(deltas[0]), (deltas, not_done, gammas), reverse=True
    )
    return advantages, advantages + values


def standardize(x: jax.Array, eps: float = 1e-8) -> jax.Array:
    """`(x - mean) / (std + eps)` over all elements; same shape as `x`."""
    return (x - x.mean()) / (x.std() + eps)
