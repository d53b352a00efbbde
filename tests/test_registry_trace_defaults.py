"""A replayed trace runs to its end: the autoscalers' synthetic 480-interval limit must not cut it.

Regression test: LLMAutoscaling-v0 set `max_steps_in_episode=480` before the trace branch's
default, so `make(..., trace=...)` truncated a replay after 480 control intervals (2 h of a
15 s interval), silently dropping the rest of the trace. Autoscaling-v0 had the same defect for
a trace given as `trace=` rather than through a named workload.
"""

import numpy as np
import pytest

import jaxserve


def _trace(n=8):
    return jaxserve.Trace(arrival_s=np.arange(n, dtype=np.float64),
                          prompt_tokens=np.full(n, 64), output_tokens=np.full(n, 16))


@pytest.mark.parametrize("name", ["Autoscaling-v0", "LLMAutoscaling-v0"])
def test_trace_replay_is_not_cut_at_the_synthetic_episode_length(name):
    _, params = jaxserve.make(name, trace=_trace())
    assert int(params.serving.max_steps_in_episode) == 1_000_000


@pytest.mark.parametrize("name", ["Autoscaling-v0", "LLMAutoscaling-v0"])
def test_synthetic_episode_length_and_explicit_override_kept(name):
    _, params = jaxserve.make(name)
    assert int(params.serving.max_steps_in_episode) == 480
    _, params = jaxserve.make(name, trace=_trace(), max_steps_in_episode=100)
    assert int(params.serving.max_steps_in_episode) == 100
