"""`jaxserve.evaluation.stats`: Student-t intervals, flat and along an axis."""

import numpy as np
import pytest
from scipy.stats import t as student_t

from jaxserve.evaluation import stats


def test_t_halfwidth_known_value_and_small_samples():
    v = [1.0, 2.0, 3.0, 4.0, np.nan]  # the NaN is left out: n = 4
    want = student_t.ppf(0.975, 3) * np.std([1, 2, 3, 4], ddof=1) / 2.0
    assert stats.t_halfwidth(v) == pytest.approx(want)
    assert np.isnan(stats.t_halfwidth([3.0]))
    # A 90% interval is narrower than the 95% one.
    assert stats.t_halfwidth(v, 0.90) < stats.t_halfwidth(v)


def test_t_halfwidth_along_axis_equals_row_by_row():
    x = np.random.default_rng(0).normal(size=(3, 5, 7))
    got = stats.t_halfwidth(x, axis=1)
    assert got.shape == (3, 7)
    for i in range(3):
        for j in range(7):
            assert got[i, j] == pytest.approx(stats.t_halfwidth(x[i, :, j]))
    assert np.all(np.isnan(stats.t_halfwidth(x[:, :1], axis=1)))
