"""The item-6 study's pieces that run without training (`agents.experiments.llm_routing_study`)."""

import numpy as np
import pytest

from jaxserve.core.types import Trace
from jaxserve.agents.experiments import llm_routing_study as S


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


def test_window_metrics_counts_preemptions_of_served_requests():
    res = {"arrival": np.array([0.0, 1.0, 2.0]), "first_token": np.array([1.0, 4.0, np.nan]),
           "finish": np.array([2.0, 8.0, np.nan]), "dropped": np.array([False, False, True]),
           "preemptions": np.array([2, 1, 5])}
    m = S.window_metrics(res, np.array([3, 5, 4]), slo_ttft=2.0, slo_tpot=1.0,
                         drop_penalty_s=600.0)
    assert m["preemptions"] == 3.0  # the dropped request's count is not a preemption


def test_compare_seeds_pools_seeds_with_the_crossed_bootstrap():
    """Two learned seeds, both better than the baseline in every window: the pooled row is
    the mean over seeds and windows, its interval excludes 0, verdicts by direction."""
    w = np.array([1.0, 2.0, 3.0, 4.0])
    pw = {"s0": {m: w for m in S.METRICS}, "s1": {m: w + 0.2 for m in S.METRICS},
          "b": {m: w + 1.0 for m in S.METRICS}}
    rows = {r["metric"]: r for r in S.compare_seeds(pw, ["s0", "s1"], ["b"])}
    assert rows["e2e_p99"]["mean"] == pytest.approx(-0.9)
    assert rows["e2e_p99"]["learned_better"] and rows["e2e_p99"]["high"] < 0
    assert rows["goodput"]["learned_worse"]  # higher is better there
    assert rows["e2e_p99"]["n"] == 8 and rows["e2e_p99"]["learned"] == "ppo_mean"


def test_bisect_capacity_finds_the_rate_that_keeps_the_target():
    """A made-up attainment curve that falls linearly in the rate: the search returns the
    rate where it crosses `target` x its light-load value, to the stated resolution, and
    the trace's own rate when that already attains it."""
    rate = 10.0

    def att(stretch):  # attainment 1 - rate / 40 (rate = 10 / stretch), floored at 0
        return max(0.0, 1.0 - (rate / stretch) / 40.0)
    out = S.bisect_capacity(att, rate, target=0.9, light_load=1 / 64, iters=14)
    light = att(64.0)
    want = 40.0 * (1.0 - 0.9 * light)  # the rate where att = 0.9 * light
    assert out["bracketed"] and out["capacity"] == pytest.approx(want, rel=2e-3)
    assert out["capacity"] <= want  # the returned end attains the target
    assert out["attainment"] >= out["target_attainment"]
    easy = S.bisect_capacity(lambda s: 1.0, rate)
    assert not easy["bracketed"] and easy["capacity"] == rate
    with pytest.raises(ValueError, match="target"):
        S.measured_capacity(None, None, None, None, slo_ttft=1.0, slo_tpot=1.0, target=0.0)


def test_prepare_takes_a_measured_capacity():
    rng = np.random.default_rng(1)
    n = 200
    tr = Trace(arrival_s=np.cumsum(rng.exponential(0.5, n)),
               prompt_tokens=rng.integers(100, 2000, n), output_tokens=rng.integers(10, 400, n))
    prep = S.prepare(tr, S.study_replicas(), load=1.25, capacity_rps=0.7)
    span = prep["train"].arrival_s[-1] - prep["train"].arrival_s[0]
    assert (len(prep["train"]) - 1) / span == pytest.approx(1.25 * 0.7, rel=1e-9)
    assert prep["capacity"] == 0.7 and prep["nominal_capacity"] > 0.7
    with pytest.raises(ValueError, match="capacity_rps"):
        S.prepare(tr, S.study_replicas(), load=1.0, capacity_rps=0.0)
