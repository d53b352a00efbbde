"""Shared, cached CartPole trainers for the agent tests (compiling is the slow part on CPU).

Import as `from tests import test_agents_common as common`; every test module then shares
this module and its caches. No tests live here.
"""

from __future__ import annotations

import functools

import gymnax
import jax
import numpy as np

from jaxserve.agents import PPOConfig, Trainer, TrainOutput, ppo

# 16 envs x 64 steps x 146 updates ~ 150k steps: solves CartPole in ~2 s after compiling.
PPO_CARTPOLE = PPOConfig(num_envs=16, num_steps=64, total_timesteps=149_504, lr=1e-3)
PPO_SEED = 0


@functools.lru_cache(maxsize=None)
def cartpole():
    """`(env, env_params)` of gymnax CartPole-v1."""
    return gymnax.make("CartPole-v1")


@functools.lru_cache(maxsize=None)
def ppo_trainer() -> Trainer:
    """The PPO trainer for `PPO_CARTPOLE`, built (and so compiled) once per process."""
    env, params = cartpole()
    return ppo.make_train(PPO_CARTPOLE, env, params)


@functools.lru_cache(maxsize=None)
def ppo_one_shot() -> TrainOutput:
    """`ppo_trainer()(key(PPO_SEED))`: a full uninterrupted run."""
    return jax.block_until_ready(ppo_trainer()(jax.random.key(PPO_SEED)))


def key_data(tree):
    """Replaces typed PRNG keys by their raw data so trees can be compared with numpy."""
    return jax.tree.map(
        lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        else x, tree)


def assert_trees_equal(a, b) -> None:
    """Bit-identical pytrees (same structure, equal leaves, NaN == NaN)."""
    a, b = key_data(a), key_data(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
