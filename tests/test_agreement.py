"""evaluation.agreement: which policies would act as a given one does, on its trajectory."""

import jax
import numpy as np
import pytest

import jaxserve
from jaxserve import policies as P
from jaxserve.core.sources import tuning_key
from jaxserve.evaluation.agreement import action_agreement


@pytest.fixture(scope="module")
def bursty():
    return jaxserve.make("Routing-v0", scenario="short_bursts", max_steps_in_episode=64)


def test_a_policy_agrees_with_itself_and_not_with_a_different_rule(bursty):
    env, params = bursty
    key = jax.random.PRNGKey(7)
    rr = P.get("round_robin")
    res = action_agreement(env, params, {"jsq": P.get("jsq"), "rr": rr},
                           {"jsq": P.get("jsq"), "rr": rr, "lwl": P.get("least_work_left")},
                           key, num_envs=3, num_steps=96, warmup=8)
    assert res["rr"]["rr"]["all"] == 1.0
    # Agreement is symmetric decision by decision only on a common trajectory; here each
    # policy acts on its own, so only the self-agreements are fixed.
    out = res["jsq"]
    assert out["jsq"]["all"] == 1.0 and out["jsq"]["by_phase"] == [1.0, 1.0]
    # Round robin ignores the state: with 4 GPUs it matches JSQ on a fraction of decisions,
    # neither never nor always.
    assert 0.0 < out["rr"]["all"] < 1.0
    assert len(out["lwl"]["by_phase"]) == 2
    # The shares are means over decisions: all lies between the phases' shares.
    lo, hi = sorted(out["rr"]["by_phase"])
    assert lo - 1e-12 <= out["rr"]["all"] <= hi + 1e-12


def test_agreement_is_measured_on_the_evaluated_trajectory(bursty):
    """Round robin's action is req_id mod N whatever the state, so its agreement with a
    policy is the share of that policy's evaluated decisions equal to req_id mod N, which
    evaluate's per-request GPU record gives independently."""
    env, params = bursty
    key = jax.random.PRNGKey(8)
    pol = P.get("least_work_left")
    out = action_agreement(env, params, {"lwl": pol}, {"rr": P.get("round_robin")}, key,
                           num_envs=2, num_steps=80)["lwl"]
    from jaxserve.evaluation.evaluate import (_run_policies, make_streams, trace_env)
    streams, keys = make_streams(key, params, 2, 80, None)
    gpu = np.asarray(_run_policies(trace_env(env, 80), (pol,), params, streams, keys,
                                   True)["gpu"])[0]
    expected = (gpu == np.arange(80)[None] % env.num_gpus).mean()
    assert out["rr"]["all"] == pytest.approx(expected, abs=1e-12)


def test_agreement_by_group(bursty):
    """With every GPU in one group every decision agrees; with the identity grouping the
    shares are the exact-GPU ones."""
    env, params = bursty
    key = jax.random.PRNGKey(10)
    pols = {"jsq": P.get("jsq")}
    refs = {"rr": P.get("round_robin")}
    one = action_agreement(env, params, pols, refs, key, 2, 48, groups=[0] * env.num_gpus)
    assert one["jsq"]["rr"]["all"] == 1.0
    ident = action_agreement(env, params, pols, refs, key, 2, 48,
                             groups=list(range(env.num_gpus)))
    assert ident == action_agreement(env, params, pols, refs, key, 2, 48)
    with pytest.raises(ValueError, match="groups"):
        action_agreement(env, params, pols, refs, key, 2, 48, groups=[0, 1])


def test_bad_input(bursty):
    env, params = bursty
    key = jax.random.PRNGKey(9)
    with pytest.raises(ValueError, match="reference"):
        action_agreement(env, params, {"j": P.get("jsq")}, {}, key, 2, 16)
    with pytest.raises(ValueError, match="policy"):
        action_agreement(env, params, {}, {"j": P.get("jsq")}, key, 2, 16)
    with pytest.raises(ValueError, match="warmup"):
        action_agreement(env, params, {"j": P.get("jsq")}, {"j": P.get("jsq")}, key, 2, 16,
                         warmup=16)
    with pytest.raises(ValueError, match="tun"):
        action_agreement(env, params, {"j": P.get("jsq")}, {"j": P.get("jsq")},
                         tuning_key(key), 2, 16)
    benv, bparams = jaxserve.make("Batching-v0")
    with pytest.raises(ValueError, match="routing"):
        action_agreement(benv, bparams, {"g": P.get("greedy")}, {"g": P.get("greedy")}, key,
                         2, 16)
