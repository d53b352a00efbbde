"""Trained Autoscaling-v0 runs as policies on the evaluation scenario.

A run trains on a scenario of its own (`agents.defaults.ENV_DEFAULTS["Autoscaling-v0"]`:
120 s decisions, step actions, random phase, count, price, trace offset); the baselines are
evaluated on the registry's 15 s target-action scenario. `load_run` reloads a finished
`jaxserve-train` run from its directory; `evaluation_overrides` drops the run's
training-only settings (`TRAINING_ONLY`) so every policy shares one evaluation environment;
`as_evaluated` adapts the run's greedy policy to it: told a price when it was trained over a
range of prices (`policies.autoscaling.told_price`), re-expressed by target
(`in_action_mode`) and deciding every k-th interval (`hold_every`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from jaxserve import agents
from jaxserve.policies import autoscaling as PA

# Environment overrides that shape training, not the evaluated scenario.
TRAINING_ONLY = ("control_interval_s", "max_steps_in_episode", "random_phase", "random_initial",
                 "invalid_penalty_s", "action_mode", "price_spread", "random_offset")


def load_run(run_dir) -> tuple[str, "object"]:
    """Reloads a finished `jaxserve-train` run on Autoscaling-v0: `(label, TrainResult)`.

    Raises:
      ValueError: not a run directory, another environment, or overrides that JSON cannot
        rebuild.
    """

    run_dir = Path(run_dir)
    meta_path = run_dir / "results.json"
    if not meta_path.exists():
        raise ValueError(f"{run_dir} has no results.json: not a jaxserve-train run directory")
    meta = json.loads(meta_path.read_text())
    if meta.get("env") != "Autoscaling-v0":
        raise ValueError(f"{run_dir} trained {meta.get('env')!r}, not Autoscaling-v0")
    overrides = meta["env_overrides"]
    if any(isinstance(v, dict) and "repr" in v for v in overrides.values()):
        raise ValueError(f"{run_dir} used overrides that cannot be rebuilt from JSON")
    cfg = {k: v for k, v in meta["config"].items()
           if k not in ("type", "total_timesteps", "seed", "num_envs")}
    for k in ("hidden_sizes", "set_dims"):
        if cfg.get(k) is not None:
            cfg[k] = tuple(cfg[k])
    result = agents.train("Autoscaling-v0", overrides, meta["algo"],
                          meta["config"]["total_timesteps"], meta["seed"],
                          num_envs=meta["config"]["num_envs"], progress=False, out_dir=run_dir,
                          resume=True, **cfg)
    return f"{meta['algo']}:{run_dir.name}", result


def evaluation_overrides(result, overrides: dict) -> dict:
    """The run's environment overrides without `TRAINING_ONLY`, under `overrides` (a given
    workload replaces the run's arrivals and trace)."""
    base = {k: v for k, v in result.env_overrides.items() if k not in TRAINING_ONLY}
    for k in ("workload", "load", "trace", "arrivals", "arrival_rate", "tokens"):
        if k in overrides:
            base.pop(k, None)
    return {**base, **overrides}


def price_conditioned(result) -> bool:
    """Whether the run trained over a range of prices (`price_spread > 1`)."""
    return float(result.env_params.price_spread) > 1.0


def as_evaluated(result, eval_params, told: float | None = None) -> Callable:
    """The run's greedy policy on the evaluation scenario `eval_params`.

    Told `told` as its price (default: none, it sees the scenario's), acting in its training
    action mode re-expressed by target, deciding every k-th interval when it trained at k
    times the evaluation's interval.

    Raises:
      ValueError: the training interval is not a whole multiple of the evaluation's.
    """

    k = float(result.env_params.control_interval_s) / float(eval_params.control_interval_s)
    if abs(k - round(k)) > 1e-6 or round(k) < 1:
        raise ValueError(f"the run decided every {float(result.env_params.control_interval_s):g}"
                         f" s, not a multiple of {float(eval_params.control_interval_s):g} s")
    pol = result.policy if told is None else PA.told_price(result.policy, told)
    pol = PA.in_action_mode(pol, int(result.env_params.action_mode))
    return PA.hold_every(pol, round(k))
