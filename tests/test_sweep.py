"""agents.sweep and scripts/sweep.py: one compiled program over seeds x (lr, ent_coef,
clip_eps); traced hyperparameters agree with the ordinary (static-config) training run."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from jaxserve import agents
from jaxserve.agents.trainer import get_hparams, set_hparams
from jaxserve.agents import sweep
from jaxserve.scripts import sweep as sweep_cli

TINY = dict(num_envs=4, num_steps=16, hidden_sizes=(8,))
STEPS = 4 * 16 * 6  # 6 updates
GRID = {"lr": (1e-3, 3e-4), "ent_coef": (0.0, 0.05)}


@functools.lru_cache(maxsize=None)
def tiny_sweep() -> sweep.SweepResult:
    return sweep.run_sweep("CartPole-v1", None, "ppo", GRID, [0, 1], STEPS, **TINY)


def test_sweep_grid_shapes_and_best():
    res = tiny_sweep()
    assert res.settings == [{"lr": 1e-3, "ent_coef": 0.0}, {"lr": 1e-3, "ent_coef": 0.05},
                            {"lr": 3e-4, "ent_coef": 0.0}, {"lr": 3e-4, "ent_coef": 0.05}]
    assert res.curves["episode_return"].shape == (4, 2, 6)
    assert res.final_return.shape == (4, 2)
    np.testing.assert_array_equal(res.env_steps, np.arange(1, 7) * 64)
    mean = np.nanmean(res.final_return, axis=1)
    assert res.best == int(np.nanargmax(mean))
    # Settings and seeds really differ: no two runs have the same losses.
    losses = res.curves["total_loss"].reshape(8, 6)
    assert len({tuple(row) for row in losses}) == 8


def test_sweep_point_matches_ordinary_training():
    """Grid point (lr=3e-4, ent_coef=0.05), seed 1 == agents.train with those static values,
    up to float reduction order under vmap."""
    res = tiny_sweep()
    single = agents.train("CartPole-v1", None, "ppo", STEPS, 1, progress=False, lr=3e-4,
                          ent_coef=0.05, **TINY)
    for name in ("total_loss", "entropy", "approx_kl"):
        np.testing.assert_allclose(res.curves[name][3, 1], single.curves[name], rtol=2e-3,
                                   atol=1e-5, err_msg=name)


def test_set_hparams_roundtrip_and_errors():
    trainer = agents.ppo.make_train(
        agents.PPOConfig(num_envs=2, num_steps=4, total_timesteps=8, num_minibatches=1),
        *agents.make_env("CartPole-v1"))
    rs = trainer.init(jax.random.key(0))
    hp = jax.device_get(get_hparams(rs.train_state))
    assert hp == pytest.approx({"lr": 2.5e-4, "ent_coef": 0.01, "clip_eps": 0.2})
    rs = set_hparams(rs, lr=1e-2, clip_eps=0.3)
    assert jax.device_get(get_hparams(rs.train_state)) == pytest.approx(
        {"lr": 1e-2, "ent_coef": 0.01, "clip_eps": 0.3})
    with pytest.raises(ValueError, match="gamma"):
        set_hparams(rs, gamma=0.9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(algo="reinforce", grid={"clip_eps": (0.1,)}), "cannot sweep"),
    (dict(grid={"gamma": (0.9,)}), "cannot sweep"),
    (dict(grid={"lr": (-1.0,)}), "lr must be"),
    (dict(seeds=[]), "at least one seed"),
])
def test_run_sweep_rejects_bad_input(kwargs, match):
    args = dict(env_name="CartPole-v1", env_overrides=None, algo="ppo", grid=GRID, seeds=[0],
                total_steps=STEPS, **TINY)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sweep.run_sweep(**args)


def test_sweep_cli_outputs_and_errors(tmp_path, capsys):
    argv = ["--env", "CartPole-v1", "--lr", "1e-3,3e-4", "--ent-coef", "0,0.05", "--seeds", "2",
            "--total-steps", str(STEPS), "--num-envs", "4", "--hp", "num_steps=16",
            "--hp", "hidden_sizes=[8]", "--out", str(tmp_path)]
    assert sweep_cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "best:" in out
    doc = json.load(open(tmp_path / "sweep.json"))
    assert len(doc["settings"]) == 4 and len(doc["final_return"][0]) == 2
    assert (tmp_path / "sweep.png").stat().st_size > 0 and (tmp_path / "sweep.csv").exists()
    assert sweep_cli.main(["--lr", "fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--lr" in err and "Traceback" not in err
