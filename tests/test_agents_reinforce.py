"""REINFORCE with a value baseline on gymnax CartPole-v1."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.agents import PPOConfig, REINFORCEConfig, reinforce
from tests import test_agents_common as common


def test_reinforce_learns_cartpole():
    env, params = common.cartpole()
    config = REINFORCEConfig(num_envs=32, num_steps=32, total_timesteps=98_304, lr=3e-3)
    out = jax.block_until_ready(reinforce.make_train(config, env, params)(jax.random.key(0)))
    returns = np.asarray(out.metrics["episode_return"])
    assert returns.shape == (config.num_updates,)
    assert set(out.metrics) == {"episode_return", "episode_length", "num_episodes",
                                "total_loss", "actor_loss", "value_loss", "entropy"}
    assert np.all(np.isfinite(np.asarray(out.metrics["total_loss"])))
    assert np.nanmean(returns[:5]) < 40.0
    assert np.nanmean(returns[-10:]) > 100.0, returns[-10:]  # random policy: ~22


def test_make_train_rejects_wrong_config():
    env, params = common.cartpole()
    with pytest.raises(ValueError, match="REINFORCEConfig"):
        reinforce.make_train(PPOConfig(total_timesteps=1024), env, params)
