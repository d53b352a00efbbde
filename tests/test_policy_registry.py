"""The policy registry, keyed by (kind, name): every LLMRouting-v0 router registered under
kind "llm_routing", generic rules registered once for several kinds, names shared by
different policies of different kinds resolved by `kind=`, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve import policies as P
from jaxserve.envs import base
from jaxserve.policies import generic as G
from jaxserve.policies import llm_routing as L
from jaxserve.policies import registry

LLM_ROUTERS = {"random": G.random_policy, "round_robin": G.round_robin,
               "power_of_two": G.power_of_two, "jsq_requests": L.jsq_requests,
               "jsq_tokens": L.jsq_tokens, "least_kv": L.least_kv, "vllm_dp": L.vllm_dp,
               "sita_prompt": L.sita_prompt, "least_marginal": G.least_marginal}
REPLICAS = [jaxserve.replica_profile("opt13b-a100-80g", max_seqs=4, queue_cap=4),
            jaxserve.replica_profile("opt13b-a100-40g", max_seqs=4, queue_cap=4),
            jaxserve.replica_profile("opt13b-a100-40g", max_seqs=4, queue_cap=4)]
STEPS = 24


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry's table and cache copied, so a test may register without leaking."""
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    monkeypatch.setattr(registry, "_CACHE", dict(registry._CACHE))


def test_llm_routing_kind_is_registered_and_read_from_the_env():
    assert "llm_routing" in base.POLICY_KINDS and "llm_routing" not in base.EVALUATED_KINDS
    env, _ = jaxserve.make("LLMRouting-v0")
    assert env.policy_kind == "llm_routing"
    assert set(P.names("llm_routing")) == set(LLM_ROUTERS)


def test_every_llm_router_is_the_module_function_and_acts_in_range():
    """`get(name, kind="llm_routing")` wraps the very function of its module (so its actions
    are unchanged), and each returns an int32 replica index on the states of a short
    episode, under one jit."""
    pols = {n: P.get(n, kind="llm_routing") for n in sorted(LLM_ROUTERS)}
    for n, pol in pols.items():
        assert pol.name == n and pol.kind == "llm_routing" and pol.fn is LLM_ROUTERS[n], n
    env, params = jaxserve.make("LLMRouting-v0", replicas=REPLICAS)
    fns = list(pols.values())

    @jax.jit
    def run(key):
        obs, state = env.reset(key, params)

        def step(carry, k):
            obs, state = carry
            k_pol, k_env = jax.random.split(k)
            acts = jnp.stack([f(k_pol, obs, state, params) for f in fns])
            obs, state, *_ = env.step(k_env, state, acts[-1], params)  # vllm_dp drives
            return (obs, state), acts

        return jax.lax.scan(step, (obs, state), jax.random.split(key, STEPS))[1]

    acts = np.asarray(run(jax.random.PRNGKey(0)))
    assert acts.dtype == np.int32 and acts.shape == (STEPS, len(fns))
    assert np.all((acts >= 0) & (acts < env.num_replicas))
    assert len(np.unique(acts)) > 1  # the routers did not all sit on one replica


def test_a_generic_rule_is_one_registration_for_both_routing_kinds():
    for name, fn in (("random", G.random_policy), ("round_robin", G.round_robin),
                     ("power_of_two", G.power_of_two), ("least_marginal", G.least_marginal)):
        assert P.kinds_of(name) == ("routing", "llm_routing")
        rt, llm = P.get(name, kind="routing"), P.get(name, kind="llm_routing")
        assert rt.fn is llm.fn is fn
        assert (rt.kind, llm.kind) == ("routing", "llm_routing")
        # Unambiguous without kind=: its primary kind, the same cached object.
        assert P.get(name) is rt and P.options(name) == ()
        with pytest.raises(ValueError, match="several kinds"):
            P.kind_of(name)
    assert P.kind_of("jsq") == "routing" and P.kinds_of("jsq") == ("routing",)


@pytest.mark.parametrize("name", ["sita_prompt"])
def test_a_name_of_two_different_policies_needs_kind(name):
    assert P.kinds_of(name) == ("routing", "llm_routing")
    for lookup in (P.get, P.options):
        with pytest.raises(ValueError, match=r"ambiguous.*'routing'.*'llm_routing'.*kind="):
            lookup(name)
    with pytest.raises(ValueError, match="several kinds"):
        P.kind_of(name)
    assert P.get(name, kind="llm_routing").fn is getattr(L, name)
    # Routing-v0's is another policy: a fitted SITA.
    assert "fit" in P.options(name, kind="routing")
    assert P.options(name, kind="llm_routing") == ("threshold",)


def test_llm_sita_prompt_takes_its_threshold():
    assert P.options("sita_prompt", kind="llm_routing") == ("threshold",)
    default = P.get("sita_prompt", kind="llm_routing")
    assert default.info["threshold"] == 512.0 and default.fn is L.sita_prompt
    low = P.get("sita_prompt", kind="llm_routing", threshold=100)
    assert low.fn is not L.sita_prompt and low.info["threshold"] == 100.0
    assert P.get("sita_prompt", kind="llm_routing", threshold=100) is low  # cached


def test_unknown_names_and_kinds_list_what_is_registered():
    with pytest.raises(ValueError, match="unknown policy 'nope'; registered: .*jsq_tokens"):
        P.get("nope")
    with pytest.raises(ValueError, match="unknown llm_routing policy 'jsq'.*kind.*'routing'.*"
                                         "jsq_requests"):
        P.get("jsq", kind="llm_routing")
    with pytest.raises(ValueError, match="unknown policy"):
        P.kinds_of("nope")
    for bad in (lambda: P.get("jsq", kind="scheduling"), lambda: P.names("scheduling"),
                lambda: P.options("jsq", kind="scheduling"),
                lambda: P.register("x", "scheduling", lambda env=None, params=None: None),
                lambda: P.register("x", ("routing", "scheduling"), lambda: None)):
        with pytest.raises(ValueError, match="kind must be one of"):
            bad()
    for kinds in ((), ("routing", "routing")):
        with pytest.raises(ValueError, match="distinct and non-empty"):
            P.register("x", kinds, lambda: None)


def test_registration_is_unique_per_kind_not_per_name(scratch_registry):
    with pytest.raises(ValueError, match="already registered"):
        P.register("jsq_tokens", "llm_routing", lambda env=None, params=None: None)
    with pytest.raises(ValueError, match=r"already registered for kind\(s\) \['routing'\]"):
        P.register_function("round_robin", ("routing", "autoscaling"), G.round_robin)
    assert "round_robin" not in P.names("autoscaling")  # nothing half-registered
    # The same name in another kind is a different policy: `get` then needs kind=.
    P.register_function("jsq", "llm_routing", L.jsq_requests)
    assert P.kinds_of("jsq") == ("routing", "llm_routing")
    assert P.get("jsq", kind="llm_routing").fn is L.jsq_requests
    with pytest.raises(ValueError, match="ambiguous"):
        P.get("jsq")


def test_imitation_finds_the_routers_of_the_env_kind():
    """`agents.imitation.heuristic` reads `env.policy_kind`: LLMRouting-v0's routers by
    name (`least_marginal`, labelled for it), and no policy of another kind."""
    from jaxserve.agents import imitation
    env, params = jaxserve.make("LLMRouting-v0", replicas=REPLICAS)
    pol = imitation.heuristic(env, params, "least_marginal", seed=0)
    assert pol.kind == "llm_routing" and pol.fn is G.least_marginal
    with pytest.raises(ValueError, match="cannot imitate 'jsq'"):
        imitation.heuristic(env, params, "jsq", seed=0)


def test_least_marginal_reads_each_engine_through_its_interface():
    """The one `least_marginal` is, on each engine, the argmin of that engine's marginal
    backlog over the servers that would not drop the request (all of them if every one
    would): `static_load.marginal_backlog` and a full queue on Routing-v0,
    `continuous_load.marginal_backlog` and `would_drop` (full queue or never fits) on
    LLMRouting-v0, checked on the states of a short random episode of each."""
    from jaxserve.core import continuous_load as CL
    from jaxserve.core import static_load as SL

    def by_definition_static(state, params):
        req = state.pending
        cost = SL.marginal_backlog(state.cluster, params.gpus, req.prompt, req.estimate)
        full = state.cluster.queues.count >= params.gpus.queue_cap
        return jnp.argmin(jnp.where(full & ~full.all(), jnp.inf, cost)).astype(jnp.int32)

    def by_definition_llm(state, params):
        req = state.pending
        cost = CL.marginal_backlog(state.cluster, params.gpus, req.prompt, req.estimate)
        bad = L.would_drop(state, params)
        return jnp.argmin(jnp.where(bad & ~bad.all(), jnp.inf, cost)).astype(jnp.int32)

    cases = [(jaxserve.make("Routing-v0"), by_definition_static),
             (jaxserve.make("LLMRouting-v0", replicas=REPLICAS), by_definition_llm)]
    for (env, params), by_definition in cases:
        @jax.jit
        def run(key):
            obs, state = env.reset(key, params)

            def step(carry, k):
                obs, state = carry
                k_a, k_env = jax.random.split(k)
                got = G.least_marginal(k_a, obs, state, params)
                want = by_definition(state, params)
                a = env.action_space(params).sample(k_a)
                obs, state, *_ = env.step(k_env, state, a, params)
                return (obs, state), (got, want)

            return jax.lax.scan(step, (obs, state), jax.random.split(key, STEPS))[1]

        got, want = run(jax.random.PRNGKey(1))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=env.name)
        assert len(np.unique(np.asarray(got))) > 1, env.name
