"""Actor-critic networks: shapes, permutation equivariance of the set network, any N."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.agents import MLPActorCritic, PPOConfig, SetActorCritic, make_network, ppo
from tests import test_agents_common as common

R, G = 3, 5


def _obs(key, n, batch=(7,)):
    return jax.random.normal(key, batch + (R + n * G,))


def _permute_gpus(obs, perm):
    n = len(perm)
    gpus = obs[..., R:].reshape(obs.shape[:-1] + (n, G))[..., perm, :]
    return jnp.concatenate([obs[..., :R], gpus.reshape(obs.shape[:-1] + (n * G,))], -1)


def test_mlp_shapes():
    net = MLPActorCritic(num_actions=3, hidden_sizes=(8, 8))
    obs = jnp.ones((2, 5, 4))
    params = jax.jit(net.init)(jax.random.key(0), obs)
    logits, value = jax.jit(net.apply)(params, obs)
    assert logits.shape == (2, 5, 3) and value.shape == (2, 5)


@pytest.mark.parametrize("mixer", ["attention", "mean"])
def test_set_network_is_permutation_equivariant_for_any_n(mixer):
    k_init, k_obs, k_perm = jax.random.split(jax.random.key(0), 3)
    make = lambda n: SetActorCritic(R, n, G, hidden_sizes=(16, 16), mixer=mixer, num_heads=4)
    params = jax.jit(make(4).init)(k_init, _obs(k_obs, 4))
    for n in (4, 6):  # the same parameters serve both cluster sizes
        apply = jax.jit(make(n).apply)
        obs = _obs(k_obs, n)
        logits, value = apply(params, obs)
        assert logits.shape == (7, n) and value.shape == (7,)
        assert np.all(np.isfinite(np.asarray(logits)))
        perm = np.asarray(jax.random.permutation(k_perm, n))
        logits_p, value_p = apply(params, _permute_gpus(obs, perm))
        np.testing.assert_allclose(logits_p, np.asarray(logits)[:, perm], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(value_p, value, rtol=1e-5, atol=1e-5)
        # Not trivially constant: GPU rows matter.
        assert np.ptp(np.asarray(logits), axis=-1).max() > 0


def test_set_network_checks_observation_size():
    net = SetActorCritic(R, 4, G)
    with pytest.raises(ValueError, match="obs_dim"):
        net.init(jax.random.key(0), jnp.ones((2, R + 3 * G)))


def test_make_network_registry():
    mlp = make_network(PPOConfig(hidden_sizes=(8,)), 2)
    assert isinstance(mlp, MLPActorCritic) and mlp.hidden_sizes == (8,)
    cfg = PPOConfig(network="set", set_dims=(R, 4, G), set_mixer="mean")
    net = make_network(cfg, 4)
    assert isinstance(net, SetActorCritic) and (net.num_gpus, net.mixer) == (4, "mean")
    with pytest.raises(ValueError, match="one action per GPU"):
        make_network(cfg, 5)


def test_set_network_in_ppo_trainer():
    """CartPole's 4-d observation read as R=2 request features + N=2 GPUs x G=1."""
    env, params = common.cartpole()
    cfg = PPOConfig(num_envs=4, num_steps=8, total_timesteps=32, num_minibatches=2,
                    network="set", set_dims=(2, 2, 1), hidden_sizes=(16,), num_heads=2)
    trainer = ppo.make_train(cfg, env, params)
    assert isinstance(trainer.network, SetActorCritic)
    runner = trainer.init(jax.random.key(0))
    logits, value = jax.jit(trainer.network.apply)(runner.train_state.params, runner.obs)
    assert logits.shape == (4, 2) and value.shape == (4,)
