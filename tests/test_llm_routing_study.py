"""The item-6 study's pieces that run without training (`agents.experiments.llm_routing_study`)."""

import numpy as np
import pytest

from jaxserve.core.types import Trace
from agents.experiments import llm_routing_study as S


def test_window_metrics_by_hand():
    # Three requests: one dropped; TTFT 1 and 3 s, TPOT (finish - first) / (o - 1).
    res = {"arrival": np.array([0.0, 1.0, 2.0]), "first_token": np.array([1.0, 4.0, np.nan]),
           "finish": np.array([2.0, 8.0, np.nan]), "dropped": np.array([False, False, True])}
    m = S.window_metrics(res, np.array([3, 5, 4]), slo_ttft=2.0, slo_tpot=1.0,
                         drop_penalty_s=600.0)
    assert m["ttft_p50"] == 2.0 and m["e2e_p50"] == 4.5
    assert m["tpot_p50"] == 0.75  # 0.5 and 1.0
    assert m["slo_attainment"] == pytest.approx(1 / 3)  # the first only (TTFT 3 s > 2 s)
    assert m["dropped"] == 1.0
    assert m["e2e_mean_drop_charged"] == pytest.approx((2.0 + 7.0 + 600.0) / 3)


def test_compare_direction():
    pw = {"a": {m: np.array([1.0, 2.0, 3.0]) for m in S.METRICS},
          "b": {m: np.array([2.0, 3.1, 4.0]) for m in S.METRICS}}
    rows = {r["metric"]: r for r in S.compare(pw, ["a"], ["b"])}
    assert rows["e2e_p99"]["learned_better"]  # lower latency
    assert rows["slo_attainment"]["learned_worse"]  # lower attainment


def test_prepare_splits_and_rescales():
    rng = np.random.default_rng(0)
    n = 400
    tr = Trace(arrival_s=np.cumsum(rng.exponential(0.5, n)),
               prompt_tokens=rng.integers(100, 2000, n), output_tokens=rng.integers(10, 400, n))
    reps = S.study_replicas()
    prep = S.prepare(tr, reps, load=0.5)
    assert len(prep["train"]) == 100 and len(prep["eval"]) == 300  # disjoint, 25% / 75%
    np.testing.assert_array_equal(prep["eval"].prompt_tokens, tr.prompt_tokens[100:])
    span = prep["train"].arrival_s[-1] - prep["train"].arrival_s[0]
    assert (len(prep["train"]) - 1) / span == pytest.approx(0.5 * prep["capacity"], rel=1e-9)
    assert prep["sita_threshold"] == float(np.median(tr.prompt_tokens[:100]))
