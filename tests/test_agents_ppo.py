"""PPO on gymnax CartPole-v1: learning, chunked == one-shot, metrics and config checks."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests import test_agents_common as common
from jaxserve.agents import PPOConfig, REINFORCEConfig, ppo

RANDOM_RETURN = 22.0  # mean CartPole-v1 return of a uniform random policy


def test_ppo_learns_cartpole():
    out = common.ppo_one_shot()
    returns = np.asarray(out.metrics["episode_return"])
    assert returns.shape == (common.PPO_CARTPOLE.num_updates,)
    assert np.nanmean(returns[:5]) < 2 * RANDOM_RETURN
    assert np.nanmean(returns[-10:]) > 200.0, returns[-10:]


def test_ppo_metrics_finite():
    metrics = common.ppo_one_shot().metrics
    expected = {"episode_return", "episode_length", "num_episodes", "total_loss", "actor_loss",
                "value_loss", "entropy", "approx_kl", "clip_frac"}
    assert set(metrics) == expected
    for name in expected - {"episode_return", "episode_length"}:
        assert np.all(np.isfinite(np.asarray(metrics[name]))), name
    # Episode means are NaN exactly when no episode finished in that update's rollout.
    finished = np.asarray(metrics["num_episodes"]) > 0
    assert finished[:3].all()  # early, short episodes; later 64-step rollouts may end none
    for name in ("episode_return", "episode_length"):
        np.testing.assert_array_equal(np.isfinite(np.asarray(metrics[name])), finished)


def test_chunked_training_is_bit_identical():
    trainer = common.ppo_trainer()
    half = trainer.num_updates // 2
    runner = trainer.init(jax.random.key(common.PPO_SEED))
    runner, first = trainer.train_chunk(runner, half)
    runner, second = trainer.train_chunk(runner, trainer.num_updates - half)
    metrics = jax.tree.map(lambda a, b: np.concatenate([a, b]), first, second)
    out = common.ppo_one_shot()
    common.assert_trees_equal(runner, out.runner_state)
    common.assert_trees_equal(metrics, out.metrics)


def test_make_train_rejects_wrong_config():
    env, params = common.cartpole()
    with pytest.raises(ValueError, match="PPOConfig"):
        ppo.make_train(REINFORCEConfig(total_timesteps=1024), env, params)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_envs=3, num_steps=5, num_minibatches=4, total_timesteps=100), "divisible"),
    (dict(num_envs=0), "num_envs"),
    (dict(gamma=1.5), "gamma"),
    (dict(clip_eps=0.0), "clip_eps"),
    (dict(network="cnn"), "network"),
    (dict(network="set"), "set_dims"),
    (dict(network="set", set_dims=(2, 3, 4), hidden_sizes=(30,), num_heads=4), "num_heads"),
    (dict(total_timesteps=10), "total_timesteps"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kwargs)
