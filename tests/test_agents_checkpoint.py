"""Checkpoint save/restore: bit-identical resume, config and metadata, clear errors."""

from __future__ import annotations

import glob
import os

import jax
import numpy as np
import pytest

from jaxserve.agents import restore_checkpoint, save_checkpoint
from jaxserve.agents.checkpoint import latest_step
from tests import test_agents_common as common


def _save_half_run(directory):
    """Trains half of the common PPO run, checkpoints it and returns the runner state."""
    trainer = common.ppo_trainer()
    half = trainer.num_updates // 2
    runner, _ = trainer.train_chunk(trainer.init(jax.random.key(common.PPO_SEED)), half)
    save_checkpoint(directory, half, runner, trainer.config, {"env": "CartPole-v1", "half": half})
    return runner


def test_resume_is_bit_identical(tmp_path):
    trainer = common.ppo_trainer()
    _save_half_run(tmp_path / "ckpt")
    # A template from a different key: everything must come from the checkpoint.
    restored = restore_checkpoint(tmp_path / "ckpt", trainer.init(jax.random.key(123)))
    half = trainer.num_updates // 2
    assert restored.step == half and latest_step(tmp_path / "ckpt") == half
    assert restored.config == trainer.config
    assert restored.metadata == {"env": "CartPole-v1", "half": half}
    runner, metrics = trainer.train_chunk(restored.runner_state, trainer.num_updates - half)
    out = common.ppo_one_shot()
    common.assert_trees_equal(runner, out.runner_state)
    common.assert_trees_equal(metrics, jax.tree.map(lambda m: m[half:], out.metrics))


def test_restore_from_abstract_template(tmp_path):
    trainer = common.ppo_trainer()
    saved = _save_half_run(tmp_path / "ckpt")
    abstract = jax.eval_shape(trainer.init, jax.random.key(0))
    restored = restore_checkpoint(tmp_path / "ckpt", abstract)
    common.assert_trees_equal(restored.runner_state, saved)
    assert restored.runner_state.train_state.apply_fn is not None


def test_missing_checkpoint_names_path(tmp_path):
    template = common.ppo_trainer().init(jax.random.key(0))
    missing = tmp_path / "nothing_here"
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        restore_checkpoint(missing, template)
    os.makedirs(missing)
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        restore_checkpoint(missing, template)
    _save_half_run(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="step 999"):
        restore_checkpoint(tmp_path / "ckpt", template, step=999)


@pytest.mark.parametrize("damage", ["array_data", "config_json", "state_item"])
def test_corrupt_checkpoint_raises_value_error(tmp_path, damage):
    directory = tmp_path / "ckpt"
    _save_half_run(directory)
    step_dir = glob.glob(str(directory / "*"))[0]
    if damage == "array_data":
        files = [f for f in glob.glob(f"{step_dir}/state/**/d/*", recursive=True)
                 if os.path.isfile(f)]
        assert files
        for f in files:
            with open(f, "wb") as fh:
                fh.write(b"not an array")
    elif damage == "config_json":
        with open(glob.glob(f"{step_dir}/config/*")[0], "w") as fh:
            fh.write("{not json")
    else:
        for f in sorted(glob.glob(f"{step_dir}/state/**", recursive=True), reverse=True):
            os.remove(f) if os.path.isfile(f) else os.rmdir(f)
    template = common.ppo_trainer().init(jax.random.key(0))
    with pytest.raises(ValueError, match=f"checkpoint at {step_dir}"):
        restore_checkpoint(directory, template)


def test_template_mismatch_raises_value_error(tmp_path):
    _save_half_run(tmp_path / "ckpt")
    template = common.ppo_trainer().init(jax.random.key(0))
    wrong = template._replace(obs=np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="could not restore"):
        restore_checkpoint(tmp_path / "ckpt", wrong)
