"""jaxserve.envs.base: policy kinds read from the environments, cached static variants."""

from __future__ import annotations

import pytest

import jaxserve
from jaxserve import policies as P
from jaxserve.envs import base


@pytest.mark.parametrize("name,kind", [("Routing-v0", "routing"), ("Batching-v0", "batching"),
                                       ("Autoscaling-v0", "autoscaling")])
def test_policy_kind_is_an_env_attribute(name, kind):
    env, params = jaxserve.make(name)
    assert base.policy_kind(env) == P.env_kind(env) == kind
    # Every default baseline of that kind is built for this env without a class switch.
    assert P.names(kind) and all(P.kind_of(n) == kind for n in P.names(kind))


def test_envs_without_registered_policies_are_refused():
    import gymnax
    env, _ = gymnax.make("CartPole-v1")
    llm, _ = jaxserve.make("LLMRouting-v0")
    for e in (env, llm, object()):
        with pytest.raises(ValueError, match="not a jaxserve"):
            base.policy_kind(e)


def test_with_static_is_cached_by_value():
    env, _ = jaxserve.make("Routing-v0")
    a = base.with_static(env, trace_len=8, log_capacity=8)
    assert a is base.with_static(env, log_capacity=8, trace_len=8)
    assert (a.trace_len, a.log_capacity, a.num_gpus) == (8, 8, env.num_gpus)
    assert a.default_params is env.default_params
    # An equal scenario built separately shares the variant (environments hash by value).
    assert base.with_static(jaxserve.make("Routing-v0")[0], trace_len=8, log_capacity=8) is a
    with pytest.raises(ValueError, match="no static field"):
        base.with_static(env, bogus=1)
