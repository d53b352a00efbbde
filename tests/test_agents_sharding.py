"""Data-parallel PPO over 4 forced host devices matches the single-device run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import pytest

from jaxserve.agents import PPOConfig, make_mesh, ppo, shard_trainer
from tests import test_agents_common as common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import gymnax, jax, numpy as np
    from jax.sharding import PartitionSpec
    from jaxserve.agents import PPOConfig, ppo, shard_trainer
    assert jax.device_count() == 4, jax.devices()
    env, params = gymnax.make("CartPole-v1")
    config = PPOConfig(num_envs=8, num_steps=16, total_timesteps=256, num_minibatches=2)
    trainer = ppo.make_train(config, env, params)
    single = trainer(jax.random.key(0))
    sharded = shard_trainer(trainer)(jax.random.key(0))
    obs, kernel = sharded.runner_state.obs, sharded.runner_state.train_state.params["params"]
    assert len(obs.sharding.device_set) == 4, obs.sharding
    assert obs.sharding.spec == PartitionSpec("data"), obs.sharding
    for leaf in jax.tree.leaves(kernel):
        assert leaf.sharding.is_fully_replicated, leaf.sharding
    kd = lambda t: jax.tree.map(lambda x: jax.random.key_data(x)
                                if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, t)
    for a, b in zip(jax.tree.leaves(kd(single)), jax.tree.leaves(kd(sharded))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    # A single-device state (e.g. a restored checkpoint) is resharded on entry.
    cont_single, _ = trainer.train_chunk(single.runner_state, 2)
    cont_sharded, _ = shard_trainer(trainer).train_chunk(single.runner_state, 2)
    for a, b in zip(jax.tree.leaves(kd(cont_single)), jax.tree.leaves(kd(cont_sharded))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    print("sharded ok", np.asarray(sharded.metrics["total_loss"]))
""")


def test_sharded_matches_single_device():
    env = dict(os.environ)
    # Fast, unoptimised CPU codegen: both runs of the comparison use it.
    env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 "
                        "--xla_backend_optimization_level=0")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    assert "sharded ok" in proc.stdout


def test_num_envs_must_divide_devices():
    devices = jax.devices() * 3  # a fake 3-"device" mesh is enough for the check
    config = PPOConfig(num_envs=4, num_steps=8, total_timesteps=32, num_minibatches=2)
    env, params = common.cartpole()
    with pytest.raises(ValueError, match="divisible by the number of devices"):
        shard_trainer(ppo.make_train(config, env, params), make_mesh(devices))
