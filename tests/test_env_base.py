"""jaxserve.envs.base: policy kinds read from the environments, typed static configuration and
its cached variants."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

import jaxserve
from jaxserve import policies as P
from jaxserve.envs import base
from jaxserve.envs.llm_prefix_routing import make_llm_prefix_routing


@pytest.mark.parametrize("name,kind", [("Routing-v0", "routing"), ("Batching-v0", "batching"),
                                       ("Autoscaling-v0", "autoscaling")])
def test_policy_kind_is_an_env_attribute(name, kind):
    env, params = jaxserve.make(name)
    assert base.policy_kind(env) == kind
    # Every default baseline of that kind is built for this env without a class switch.
    assert P.names(kind) and all(kind in P.kinds_of(n) for n in P.names(kind))


def test_envs_the_evaluation_clis_do_not_handle_are_refused():
    import gymnax
    env, _ = gymnax.make("CartPole-v1")
    llm, _ = jaxserve.make("LLMRouting-v0")
    assert llm.policy_kind == "llm_routing" and P.names("llm_routing")
    for e in (env, llm, object()):
        with pytest.raises(ValueError, match="not a jaxserve"):
            base.policy_kind(e)
    with pytest.raises(ValueError, match="'llm_routing' policies"):
        base.policy_kind(llm)  # compared by agents.experiments.llm_routing_study


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


# ------------------------------------------------------------------------ static configuration

STATIC_TYPES = {"Routing-v0": "RoutingStatic", "Batching-v0": "BatchingStatic",
                "Autoscaling-v0": "AutoscalingStatic", "LLMRouting-v0": "LLMRoutingStatic",
                "LLMAutoscaling-v0": "LLMAutoscalingStatic",
                "LLMPrefixRouting-v0": "LLMRoutingStatic"}


@pytest.mark.parametrize("name", sorted(STATIC_TYPES))
def test_static_is_a_frozen_dataclass_read_through_attributes(name):
    env, _ = jaxserve.make(name)
    static = env.static
    assert type(static).__name__ == STATIC_TYPES[name] and type(env).Static is type(static)
    for f in dataclasses.fields(static):
        assert getattr(env, f.name) == getattr(static, f.name)
    first = dataclasses.fields(static)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(static, first, 3)
    with pytest.raises(AttributeError, match="replace_static"):
        setattr(env, first, 3)
    with pytest.raises(AttributeError):
        env.no_such_field  # noqa: B018
    # Rebuilding with the same fields gives an equal env (one jit cache entry); a changed
    # field a different one, with only that field changed.
    same = env.replace_static()
    assert same == env and hash(same) == hash(env) and same.static == static
    longer = env.replace_static(trace_len=static.trace_len + 5)
    assert longer != env and longer.trace_len == static.trace_len + 5
    assert dataclasses.replace(longer.static, trace_len=static.trace_len) == static
    assert longer.default_params is env.default_params


@pytest.mark.parametrize("name,changes,match", [
    ("Routing-v0", {"num_gpus": 0}, "num_gpus must be >= 1"),
    ("Routing-v0", {"queue_buffer": 0}, "queue_buffer must be >= 1"),
    ("Routing-v0", {"log_capacity": -1}, "log_capacity must be >= 0"),
    ("Routing-v0", {"max_batch": 2.5}, "max_batch must be an integer"),
    ("Routing-v0", {"trace_len": "8"}, "trace_len must be an integer"),
    ("Routing-v0", {"shaping_gamma": 1.5}, "shaping_gamma"),
    ("Batching-v0", {"max_batch": 0}, "max_batch must be >= 1"),
    ("Autoscaling-v0", {"history_len": 0}, "history_len must be >= 1"),
    ("LLMRouting-v0", {"max_seqs": 0}, "max_seqs must be >= 1"),
    ("Routing-v0", {"bogus": 1}, "no static field"),
])
def test_bad_static_configuration_is_a_value_error(name, changes, match):
    env, _ = jaxserve.make(name)
    with pytest.raises(ValueError, match=match):
        env.replace_static(**changes)


def test_static_fields_are_normalised_so_equal_configs_hash_equal():
    env, _ = jaxserve.make("Routing-v0")
    a = env.replace_static(trace_len=np.int64(8), shaping_gamma=1)
    b = env.replace_static(trace_len=8.0, shaping_gamma=1.0)
    assert type(a.trace_len) is int and type(a.shaping_gamma) is float
    assert a == b and hash(a) == hash(b)
    assert env.replace_static(shaping_gamma=None).shaping_gamma is None


def test_policy_kinds_are_defined_once():
    assert P.KINDS is base.POLICY_KINDS and set(base.EVALUATED_KINDS) < set(base.POLICY_KINDS)
    prefix, _ = make_llm_prefix_routing()
    assert prefix.policy_kind in base.POLICY_KINDS and P.names(prefix.policy_kind)
    with pytest.raises(ValueError, match="not a jaxserve"):
        base.policy_kind(prefix)  # its routers are compared by scripts/prefix_routers.py


def test_each_builder_lives_beside_its_environment():
    """The registry holds the table and `make` only: every registered builder is
    defined in an environment module that holds the class it builds (LLMPrefixRouting-v0's
    module owns its scenario and builds LLMRouting-v0's class with prefix caching on)."""
    import jaxserve
    from jaxserve.envs import registry

    public = {n for n in vars(registry) if not n.startswith("_")
              and getattr(vars(registry)[n], "__module__", None) == registry.__name__}
    assert public == {"make", "register", "registered_envs"}
    for name, builder in registry._REGISTRY.items():
        env, _ = jaxserve.make(name)
        module = sys.modules[builder.__module__]
        assert module is not registry and getattr(module, type(env).__name__) is type(env), name


# ------------------------------------------------------------------------ where defaults live

def test_defaults_are_the_params_fields_then_each_envs_dict():
    """The shared defaults are `ServingParams`' (and `AutoscalingParams`') field defaults, each
    environment's own are its builder's dict, and `make`'s keywords win over both
    (docs/index.md, "Where defaults live")."""
    from jaxserve.envs import autoscaling, batching, common, llm_autoscaling, llm_routing, routing

    shared = {f.name: f.default for f in dataclasses.fields(common.ServingParams)
              if f.name in common.SCALAR_FIELDS}
    own = {"Routing-v0": routing.ROUTING_DEFAULTS, "Batching-v0": batching.BATCHING_DEFAULTS,
           "LLMRouting-v0": llm_routing.LLM_ROUTING_DEFAULTS}
    for name, table in own.items():
        _, params = jaxserve.make(name)
        for f, v in shared.items():
            want = table.get(f, v)
            assert np.asarray(getattr(params, f)) == np.asarray(want, np.float32), (name, f)
            assert np.asarray(getattr(params, f)).dtype == common.SCALAR_FIELDS[f]
    _, params = jaxserve.make("Routing-v0", slo_s=12.0)
    assert float(params.slo_s) == 12.0  # the caller's keyword wins
    _, ap = jaxserve.make("Autoscaling-v0")
    for f in dataclasses.fields(autoscaling.AutoscalingParams):
        if f.name in autoscaling.SCALING_FIELDS:
            assert np.asarray(getattr(ap, f.name)) == np.asarray(f.default, np.float32)
    assert float(ap.serving.slo_s) == autoscaling.AUTOSCALING_DEFAULTS["slo_s"]
    _, lp = jaxserve.make("LLMAutoscaling-v0")
    assert float(lp.warmup_s) == llm_autoscaling.LLM_AUTOSCALING_DEFAULTS["warmup_s"]


def test_llm_autoscaling_running_slots_are_named_max_seqs():
    """One name per quantity: LLMAutoscaling-v0's static running slots are `max_seqs`, as
    LLMRouting-v0's and the replicas' own field; the old name says where it went."""
    env, params = jaxserve.make("LLMAutoscaling-v0", max_seqs=32)
    assert env.max_seqs == 32 and env.static.max_seqs == 32
    with pytest.raises(AttributeError, match="max_seqs"):
        env.max_batch
    with pytest.raises(ValueError, match="no static field"):
        env.replace_static(max_batch=32)
