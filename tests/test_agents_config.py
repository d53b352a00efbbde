"""Config round trips and derived sizes."""

from __future__ import annotations

import json

import pytest

from jaxserve.agents import PPOConfig, REINFORCEConfig, config_from_dict


@pytest.mark.parametrize("config", [
    PPOConfig(network="set", set_dims=(2, 3, 4), hidden_sizes=(32, 32), seed=7),
    REINFORCEConfig(num_envs=8, lr=3e-3, normalize_advantages=False),
])
def test_json_round_trip(config):
    restored = config_from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config and type(restored) is type(config)
    assert hash(restored) == hash(config)


def test_derived_sizes():
    c = PPOConfig(num_envs=4, num_steps=128, total_timesteps=10_000, num_minibatches=8)
    assert (c.batch_size, c.num_updates, c.minibatch_size) == (512, 19, 64)
    assert c.grad_steps_per_update == c.update_epochs * c.num_minibatches
    assert REINFORCEConfig().grad_steps_per_update == 1


def test_config_from_dict_errors():
    with pytest.raises(ValueError, match="unknown config type"):
        config_from_dict({"type": "DQNConfig"})
    with pytest.raises(ValueError, match="clip_eps"):
        config_from_dict({"type": "REINFORCEConfig", "clip_eps": 0.2})
