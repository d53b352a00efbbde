"""The files of a training run's directory: metrics CSV, learning-curve plot, checkpoint
metadata (env, overrides, algorithm, curves, wall time) and restoring a run from it."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxserve.agents.checkpoint import latest_step, restore_checkpoint
from jaxserve.agents.trainer import Trainer

CHECKPOINT_DIR = "checkpoints"
METRICS_CSV = "metrics.csv"
CURVE_PNG = "learning_curve.png"


def check_out_dir(out: Path | None, *, resume: bool, overwrite: bool,
                  resume_flag: str = "resume=True", overwrite_flag: str = "overwrite=True",
                  out_flag: str = "out_dir", refuse_foreign: bool = False) -> bool:
    """Checks what a training run may do with its run directory `out`, before any writing.

    The `*_flag` strings are how the caller's user spells the options (`resume=True` for
    `agents.train`, `--resume` for `jaxserve-train`), so each message names what to change.

    Returns:
      whether `out` already holds a run of ours (a checkpoint under `out/checkpoints`).
    Raises:
      ValueError: `resume` without `out`, `resume` with `overwrite`, `out` is not a directory,
        `out` holds a run and neither `resume` nor `overwrite` is given, or (with
        `refuse_foreign`) `out` is a non-empty directory that holds no run and `overwrite` is
        not given (its files would be replaced without a word).
      FileNotFoundError: `resume` and no checkpoint under `out`.
    """
    if resume and out is None:
        raise ValueError(f"{resume_flag} needs {out_flag} (where the checkpoints are)")
    if resume and overwrite:
        raise ValueError(f"{resume_flag} and {overwrite_flag} contradict each other")
    if out is None:
        return False
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out_flag} {out} exists and is not a directory")
    ckpt_dir = (out / CHECKPOINT_DIR).absolute()
    ours = ckpt_dir.is_dir() and latest_step(ckpt_dir) is not None
    if resume and not ours:
        raise FileNotFoundError(f"{resume_flag} but there is no checkpoint under {ckpt_dir}")
    if not resume and ours and not overwrite:
        raise ValueError(f"{out} already holds a training run; pass {resume_flag} to "
                         f"continue it or {overwrite_flag} to replace it")
    if (refuse_foreign and not ours and not overwrite and out.is_dir()
            and any(out.iterdir())):
        raise ValueError(f"{out} is not empty and holds no training run (no checkpoint under "
                         f"{CHECKPOINT_DIR}/); its files (e.g. results.json, results.csv, "
                         f"{METRICS_CSV}, {CURVE_PNG}) would be replaced: pass {overwrite_flag} "
                         f"to write there anyway, or choose another {out_flag}")
    return ours


def jsonable_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides as JSON: values JSON cannot hold are stored as `{"repr": repr(value)}`."""
    out = {}
    for k, v in sorted(overrides.items()):
        try:
            json.dumps(v, allow_nan=False)
            out[k] = v
        except (TypeError, ValueError):
            out[k] = {"repr": repr(v)}
    return json.loads(json.dumps(out))


def _curves_to_json(curves: dict[str, np.ndarray]) -> dict[str, list]:
    return {k: [None if not np.isfinite(x) else float(x) for x in np.asarray(v, np.float64)]
            for k, v in curves.items()}


def _curves_from_json(d: dict[str, list]) -> dict[str, np.ndarray]:
    return {k: np.array([np.nan if x is None else x for x in v], np.float64)
            for k, v in d.items()}


def _write_csv(path: Path, curves: dict[str, np.ndarray], mode: str = "w",
               start: int = 0) -> None:
    names = list(curves)
    with open(path, mode, newline="") as f:
        w = csv.writer(f)
        if mode == "w":
            w.writerow(names)
        for i in range(start, len(curves["update"])):
            w.writerow([_fmt(curves[k][i]) for k in names])


def _fmt(x: float) -> str:
    x = float(x)
    if not np.isfinite(x):
        return "nan"
    return str(int(x)) if x == int(x) and abs(x) < 2**53 else repr(x)


def plot_learning_curve(curves: dict[str, np.ndarray], path: str | os.PathLike,
                        title: str = "") -> None:
    """Episode return, losses and entropy against environment steps, saved as a PNG."""
    # deferred: the Agg backend must be chosen before pyplot is imported, and only where a
    # figure is drawn, not for every importer of this module
    import matplotlib  # deferred: see above
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: see above

    steps = curves["env_steps"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    ret = curves["episode_return"]
    ok = np.isfinite(ret)
    axes[0].plot(steps[ok], ret[ok], lw=1.2)
    axes[0].set_ylabel("mean episode return")
    for name in ("actor_loss", "value_loss"):
        if name in curves:
            axes[1].plot(steps, curves[name], lw=1.0, label=name)
    axes[1].set_yscale("symlog", linthresh=1e-2)
    axes[1].legend()
    axes[1].set_ylabel("loss")
    axes[2].plot(steps, curves["entropy"], lw=1.0)
    axes[2].set_ylabel("policy entropy")
    for ax in axes:
        ax.set_xlabel("environment steps")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _metadata(env_name, overrides, algo, curves, wall, chunk, imitate=None):
    meta = {"env_name": env_name, "env_overrides": jsonable_overrides(overrides), "algo": algo,
            "curves": _curves_to_json(curves), "wall_time_s": wall, "chunk_updates": chunk}
    if imitate is not None:  # absent otherwise, so runs saved before the option still resume
        meta["imitate"] = imitate
    return meta


def _restore(ckpt_dir: Path, trainer: Trainer, key, env_name, overrides, algo, imitate=None):
    if latest_step(ckpt_dir) is None:
        raise FileNotFoundError(f"resume=True but there is no checkpoint under {ckpt_dir}")
    template = jax.eval_shape(trainer.init, key)
    try:
        ckpt = restore_checkpoint(ckpt_dir, template)
    except ValueError as e:
        raise ValueError(f"cannot resume: {e}") from None
    meta = ckpt.metadata
    want = {"env_name": env_name, "env_overrides": jsonable_overrides(overrides), "algo": algo,
            "imitate": imitate}
    got = {k: meta.get(k) for k in want}
    if got != want:
        raise ValueError(f"cannot resume: the checkpoint under {ckpt_dir} is of run {got}, "
                         f"not {want}")
    if ckpt.config != trainer.config:
        a, b = ckpt.config.to_dict(), trainer.config.to_dict()
        diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        raise ValueError(f"cannot resume: config differs from the checkpoint's "
                         f"(field: (saved, requested)): {diff}")
    if "curves" not in meta:
        raise ValueError(f"cannot resume: checkpoint under {ckpt_dir} has no learning curves "
                         f"(not written by agents.train)")
    curves = _curves_from_json(meta["curves"])
    if len(curves.get("update", [])) != ckpt.step:
        raise ValueError(f"cannot resume: checkpoint step {ckpt.step} does not match its "
                         f"{len(curves.get('update', []))} recorded updates")
    return (ckpt.runner_state, ckpt.step, curves,
            float(meta.get("wall_time_s", 0.0)))
