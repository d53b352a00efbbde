"""agents.evaluate: the learned-vs-heuristics comparison that jaxserve-train prints, as library
code (baselines per environment kind, paired verdicts, fresh evaluation keys)."""

from __future__ import annotations

import types

import numpy as np
import pytest

import jaxserve
from jaxserve.agents import evaluate as E


def _result(per_env_incl, mean=None):
    per = np.asarray(per_env_incl, np.float64)
    return {"per_env": {"latency_incl_drops": per,
                        "mean_latency": per if mean is None else np.asarray(mean, np.float64),
                        "goodput": np.ones_like(per)}}


def test_paired_verdicts_sign_and_significance():
    learned = [10.0, 11.0, 12.0, 13.0]
    results = {"ppo": _result(learned),
               "slow": _result([x + 5.0 + 0.1 * i for i, x in enumerate(learned)]),
               "fast": _result([x - 3.0 - 0.1 * i for i, x in enumerate(learned)]),
               "same": _result([x + (-1) ** i * 0.5 for i, x in enumerate(learned)]),
               "ppo-sampled": _result(learned)}
    v = E.paired_verdicts(results, "ppo")
    assert set(v) == {"slow", "fast", "same"}  # learned variants are not compared
    assert v["slow"]["verdict"] == "better" and v["fast"]["verdict"] == "worse"
    assert v["same"]["verdict"] == "no significant difference"
    d = v["slow"]["difference"][E.VERDICT_METRIC]
    # learned - baseline: the per-env differences are -5.0, -5.1, -5.2, -5.3.
    assert d["mean"] == pytest.approx(-5.15) and d["n"] == 4 and d["low"] < d["high"] < 0


def test_baseline_policies_defaults_and_errors():
    env, params = jaxserve.make("Routing-v0")
    pols = E.baseline_policies("routing", env, params, "jsq,round_robin")
    assert list(pols) == ["jsq", "round_robin"]
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        E.baseline_policies("routing", env, params, "nope")
    envb, pb = jaxserve.make("Batching-v0")
    with pytest.raises(ValueError, match="unknown batching policy 'jsq'"):
        E.baseline_policies("batching", envb, pb, "jsq")
    enva, pa = jaxserve.make("Autoscaling-v0", max_replicas=3)
    pols = E.baseline_policies("autoscaling", enva, pa, "fixed,hpa")
    assert list(pols) == ["fixed-1", "fixed-2", "fixed-3", "hpa"]


def test_evaluate_run_refuses_the_training_seed():
    env, params = jaxserve.make("Routing-v0")
    result = types.SimpleNamespace(env=env, env_params=params, algo="ppo", policy=None)
    with pytest.raises(ValueError, match="must differ"):
        E.evaluate_run(result, seed=3, eval_seed=3)
