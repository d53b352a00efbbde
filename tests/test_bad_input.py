"""Bad input (issue #24): what is accepted can neither overflow, hang nor vanish; the rest is
refused with a ValueError naming the field.

One test (or group) per case of the issue, each failing on the code before the fix:
1. token counts near 2^31 (int32 overflow in the continuous engine's never-fit check);
2. arrival rates whose gaps float32 cannot resolve (Batching-v0's arrival loop never ends) or
   that are so small the gaps are infinite;
3. float actions (1.7, -0.5, NaN, inf) counted in `info["invalid_actions"]` in every env;
4. loaders (tests/test_bad_input.py::test_damaged_* and tests/test_traces_loaders.py);
5. silent coercion of integers, booleans and strings;
6. `jaxserve-train --out DIR` on a non-empty directory that holds no run.
Then a hypothesis property test over `make` overrides, GPU profiles and `Trace` arrays.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import jaxserve
from jaxserve.core import arrivals as A
from jaxserve.core.replica import ReplicaProfile, replica_profile
from jaxserve.core.types import MAX_TOKENS, GPUProfile
from jaxserve.envs import common

ALL_ENVS = ("Routing-v0", "Batching-v0", "LLMRouting-v0", "Autoscaling-v0",
            "LLMAutoscaling-v0")


# ------------------------------------------------------------------ 1. token counts bounded

def test_case1_huge_token_trace_refused_by_name():
    # The reproduction: 3e9 tokens were admitted and the request vanished.
    tr = jaxserve.Trace(np.array([0.0, 1.0]), np.array([3 * 10 ** 9] * 2), np.array([10, 10]))
    with pytest.raises(ValueError, match=r"Trace\.prompt_tokens\[0\] must be <= 16777216"):
        jaxserve.make("LLMRouting-v0", trace=tr)
    # prompt and output each fit, their sum does not.
    tr = jaxserve.Trace(np.array([0.0]), np.array([MAX_TOKENS - 5]), np.array([10]))
    with pytest.raises(ValueError, match=r"prompt_tokens\[0\] \+ Trace\.output_tokens\[0\]"):
        tr.validate()
    with pytest.raises(ValueError, match=r"tokens\.max_prompt \+ params\.tokens\.max_output"):
        jaxserve.make("Routing-v0", tokens=A.lognormal_tokens(100, 0.1, 100, 0.1,
                                                              max_prompt=2 ** 24,
                                                              max_output=2 ** 24))


def test_case1_token_headroom_against_slots():
    # Requests that fit 2^24 but whose int32 sums over many running slots would not.
    reps = [replica_profile("opt13b-a100-80g", max_seqs=256)]
    with pytest.raises(ValueError, match="running slots"):
        jaxserve.make("LLMRouting-v0", replicas=reps,
                      tokens=A.lognormal_tokens(100, 0.1, 100, 0.1, max_prompt=2 ** 23,
                                                max_output=2 ** 23))


def test_case1_largest_accepted_request_is_dropped_not_lost():
    # A request at the bound never fits the KV cache: dropped (counted), not admitted forever.
    tr = jaxserve.Trace(np.array([0.0, 1.0]), np.array([MAX_TOKENS - 10] * 2),
                        np.array([10, 10]))
    env, params = jaxserve.make("LLMRouting-v0", trace=tr)
    _, state = env.reset(jax.random.PRNGKey(0), params)
    step = jax.jit(env.step_env)
    done = dropped = 0
    for i in range(2):
        _, state, _, term, info = step(jax.random.PRNGKey(i), state, jnp.int32(0), params)
        done += int(info["completed"])
        dropped += int(info["dropped"])
    assert bool(term) and done + dropped == 2 and dropped == 2


# ---------------------------------------------------------------- 2./3. rates and the loops

@pytest.mark.parametrize("name", ["Batching-v0", "Autoscaling-v0"])
def test_case2_rates_float32_cannot_resolve_refused(name):
    with pytest.raises(ValueError, match=r"arrival_rate= or arrivals=\): a rate of 1e\+30 req/s"):
        jaxserve.make(name, arrival_rate=1e30)


@pytest.mark.parametrize("name", ["Routing-v0", "Batching-v0", "Autoscaling-v0"])
def test_case2_rates_with_infinite_gaps_refused(name):
    with pytest.raises(ValueError, match=r"arrivals\.rates must be >= 1e-07"):
        jaxserve.make(name, arrival_rate=1e-40)


def test_case3_loop_bound_also_checked_on_params_built_by_hand():
    env, params = jaxserve.make("Batching-v0")
    fast = params.replace(arrivals=A.poisson(1e30))
    with pytest.raises(ValueError, match="arrivals per event loop"):
        env.check_params(fast)
    env, params = jaxserve.make("Autoscaling-v0")
    fast = params.replace(serving=params.serving.replace(arrivals=A.poisson(1e30)))
    with pytest.raises(ValueError, match="arrivals per event loop"):
        env.check_params(fast)


# ---------------------------------------------------------------------- 3. float actions

FLOAT_ACTIONS = jnp.asarray([1.7, -0.5, jnp.nan, jnp.inf, -jnp.inf, 1.0, 0.0], jnp.float32)
EXPECT_INVALID = np.array([1, 1, 1, 1, 1, 0, 0])


def test_discrete_action_mapping():
    idx, bad = jax.jit(jax.vmap(lambda a: common.discrete_action(a, 4)))(FLOAT_ACTIONS)
    np.testing.assert_array_equal(np.asarray(idx), [1, 0, 0, 3, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(bad), EXPECT_INVALID.astype(bool))
    idx, bad = common.discrete_action(jnp.asarray([-1, 0, 3, 4, 2 ** 31 - 1], jnp.int32), 4)
    np.testing.assert_array_equal(np.asarray(idx), [0, 0, 3, 3, 3])
    np.testing.assert_array_equal(np.asarray(bad), [True, False, False, True, True])


@pytest.mark.parametrize("name", ALL_ENVS)
def test_case3_float_actions_counted_invalid(name):
    kw = {"max_replicas": 2} if "Autoscaling" in name else {}
    env, params = jaxserve.make(name, **kw)
    _, state = env.reset(jax.random.PRNGKey(0), params)
    step = jax.jit(jax.vmap(env.step_env, in_axes=(None, None, 0, None)))
    *_, info = step(jax.random.PRNGKey(1), state, FLOAT_ACTIONS, params)
    bad = np.asarray(info["invalid_actions"])
    if name == "Batching-v0":
        # 1.0 asks for one request: valid only if one waits (reset leaves >= 1 waiting).
        assert int(state.cluster.queues.count[0]) >= 1
    if "Autoscaling" in name:
        # Action 1.0 -> 2 replicas (valid); 0.0 -> 1 replica (valid); NaN -> action 0.
        np.testing.assert_array_equal(bad[:5], 1)
        np.testing.assert_array_equal(bad[5:], 0)
        np.testing.assert_array_equal(np.asarray(info["active"]), [2, 1, 1, 2, 1, 2, 1])
    else:
        np.testing.assert_array_equal(bad, EXPECT_INVALID)


# ------------------------------------------------------------------- 5. silent coercion

@pytest.mark.parametrize("name, kw, field", [
    ("Routing-v0", {"max_steps_in_episode": 2.5}, "max_steps_in_episode"),
    ("Routing-v0", {"estimate_mode": 1.5}, "estimate_mode"),
    ("Routing-v0", {"estimate_mode": True}, "estimate_mode"),
    ("Routing-v0", {"estimate_mode": 3}, "estimate_mode"),
    ("Routing-v0", {"slo_s": "10"}, "slo_s"),
    ("Routing-v0", {"arrival_rate": "2"}, "arrival_rate"),
    ("Routing-v0", {"queue_buffer": 4.5}, "queue_buffer"),
    ("Routing-v0", {"queue_buffer": "64"}, "queue_buffer"),
    ("Routing-v0", {"latency_scale": 1e-30}, "latency_scale"),
    ("Routing-v0", {"drop_penalty_s": 1e30}, "drop_penalty_s"),
    ("Routing-v0", {"gpus": [GPUProfile(max_batch="8")]}, "max_batch"),
    ("Routing-v0", {"gpus": [GPUProfile(queue_cap=1e12)]}, "queue_cap"),
    ("Routing-v0", {"gpus": [GPUProfile(max_batch=2.5)]}, "max_batch"),
    ("Routing-v0", {"gpus": [GPUProfile(c0="fast")]}, "c0"),
    ("Autoscaling-v0", {"max_replicas": "4"}, "max_replicas"),
    ("Autoscaling-v0", {"max_replicas": 2.5}, "max_replicas"),
    ("Autoscaling-v0", {"initial_replicas": 1.5}, "initial_replicas"),
    ("Autoscaling-v0", {"control_interval_s": "15"}, "control_interval_s"),
    ("LLMRouting-v0", {"replicas": [ReplicaProfile(chunked_prefill="no")]}, "chunked_prefill"),
    ("LLMRouting-v0", {"replicas": [ReplicaProfile(chunked_prefill=1)]}, "chunked_prefill"),
    ("LLMRouting-v0", {"replicas": [ReplicaProfile(kv_blocks=2 ** 40)]}, "kv_blocks"),
    ("LLMRouting-v0", {"max_seqs": "64"}, "max_seqs"),
    ("LLMAutoscaling-v0", {"max_replicas": "4"}, "max_replicas"),
])
def test_case5_no_silent_coercion(name, kw, field):
    with pytest.raises(ValueError, match=field):
        jaxserve.make(name, **kw)


def test_case5_integral_floats_still_accepted():
    env, params = jaxserve.make("Routing-v0", max_steps_in_episode=16.0, estimate_mode=np.int64(0),
                                gpus=[GPUProfile(max_batch=8.0, queue_cap=np.int32(32))])
    assert int(params.max_steps_in_episode) == 16 and int(params.estimate_mode) == 0
    assert env.queue_buffer == 32


# --------------------------------------------------------------------------- 6. the CLI

def test_case6_cli_refuses_a_foreign_nonempty_out(tmp_path, capsys):
    from scripts import train as train_cli

    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.json").write_text('{"keep": "me"}')
    assert train_cli.main(["--out", str(out), "--total-steps", "1000", "--no-eval",
                           "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err, err
    assert (out / "results.json").read_text() == '{"keep": "me"}'
    # The refusal messages name the CLI's flags, not the Python arguments.
    assert train_cli.main(["--out", str(out), "--resume", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "--resume and --overwrite contradict" in err and "resume=True" not in err, err
    assert train_cli.main(["--out", str(tmp_path / "none"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume but there is no checkpoint" in err, err


def test_case6_out_dir_check_names_flags(tmp_path):
    from agents.run_dir import check_out_dir

    (tmp_path / "x").write_text("x")
    assert check_out_dir(tmp_path, resume=False, overwrite=False) is False  # library: allowed
    with pytest.raises(ValueError, match="pass --overwrite"):
        check_out_dir(tmp_path, resume=False, overwrite=False, overwrite_flag="--overwrite",
                      refuse_foreign=True)
    assert check_out_dir(tmp_path, resume=False, overwrite=True, refuse_foreign=True) is False
    assert check_out_dir(tmp_path / "new", resume=False, overwrite=False,
                         refuse_foreign=True) is False


# ------------------------------------------------------------- property test (hypothesis)

_WEIRD_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e-45, 1e-40, 1e-7, 0.5, 1.0, 2.5, 3.0, 1e6,
                 2.0 ** 24, 2.0 ** 31, 1e30, 1e300, -1.0, -1e30, math.nan, math.inf, -math.inf]
ANY_NUMBER = st.one_of(
    st.sampled_from(_WEIRD_FLOATS),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.integers(min_value=-3, max_value=40),
)
ANY_VALUE = st.one_of(ANY_NUMBER, ANY_NUMBER, st.booleans(), st.none(),
                      st.sampled_from(["4", "no", ""]))
# Values a user would pass, so that a good share of draws is accepted and runs.
PLAUSIBLE = st.one_of(st.floats(min_value=0.05, max_value=50.0), st.integers(0, 16))
MIXED = st.one_of(PLAUSIBLE, PLAUSIBLE, ANY_VALUE)


@st.composite
def columns(draw, plausible):
    """A trace column of `TRACE_ROWS` plausible values, one of them replaced (half the time)
    by anything at all."""
    col = draw(st.lists(plausible, min_size=TRACE_ROWS, max_size=TRACE_ROWS))
    if draw(st.booleans()):
        col[draw(st.integers(0, TRACE_ROWS - 1))] = draw(ANY_VALUE)
    return col


SERVING_FIELDS = ("arrival_rate", "slo_s", "latency_scale", "drop_penalty_s", "time_scale",
                  "estimate_noise", "estimate_mode", "max_steps_in_episode")
PROFILE_FIELDS = ("c0", "alpha", "alpha2", "beta", "gamma", "delta", "timeout", "max_batch",
                  "queue_cap")
TRACE_ROWS = 4
STEPS = 50
LANES = 2


def _canonical(env):
    """`env` without its default params, with at least 64 queue and 16 batch slots, so that
    draws of one environment share one compiled rollout (a larger drawn size compiles anew)."""
    fields = {f.name: getattr(env.static, f.name) for f in dataclasses.fields(env.static)}
    fields["queue_buffer"] = max(fields["queue_buffer"], 64)
    fields["max_batch"] = max(fields["max_batch"], 16)
    return type(env)(default=None, **fields)


def _rollout(env, params, key):
    """`STEPS` step_env calls (no auto-reset) with uniform random actions, from one reset."""
    _, state = env.reset_env(key, params)

    def step(state, k):
        k_a, k_s = jax.random.split(k)
        a = jax.random.randint(k_a, (), 0, env.num_actions)
        obs, state, r, term, info = env.step_env(k_s, state, a, params)
        c = state.cluster
        held = (c.queues.count + c.servers.run_count).sum()
        ids = (state.pending if hasattr(state, "pending") else state.upcoming).req_id
        out = dict(obs=obs, reward=r, term=term, held=held, ids=ids,
                   completed=info["completed"], dropped=info["dropped"])
        return state, out

    return jax.lax.scan(step, state, jax.random.split(key, STEPS))[1]


_vrollout = jax.jit(jax.vmap(_rollout, in_axes=(None, None, 0)), static_argnums=0)


def _check_run(env, params):
    out = jax.device_get(_vrollout(_canonical(env), params,
                                   jax.random.split(jax.random.PRNGKey(7), LANES)))
    for k in ("obs", "reward"):
        assert np.all(np.isfinite(np.asarray(out[k], np.float64))), k
    # Conservation up to (and including) the terminating step: every request that arrived
    # (ids: requests routed, Routing-v0; arrived so far, Batching-v0) is completed, held
    # or dropped. Batching-v0's reset admits its first arrivals before any step.
    live = np.cumsum(np.asarray(out["term"]), axis=1) - np.asarray(out["term"]) == 0
    completed = np.cumsum(out["completed"], axis=1)
    dropped = np.cumsum(out["dropped"], axis=1)
    lhs = np.asarray(out["ids"])
    rhs = completed + dropped + np.asarray(out["held"])
    np.testing.assert_array_equal(np.where(live, lhs, 0), np.where(live, rhs, 0))


def _refusal_names(err: ValueError, names) -> bool:
    msg = str(err)
    return any(n in msg for n in names)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(["Routing-v0", "Batching-v0"]),
       overrides=st.dictionaries(st.sampled_from(SERVING_FIELDS), MIXED, min_size=1,
                                 max_size=3),
       profile=st.dictionaries(st.sampled_from(PROFILE_FIELDS), MIXED, max_size=2))
# The cases first: a rate float32 cannot resolve (reset never returned), a profile
# whose service time no float32 clock can step through at the default rate.
@example(name="Batching-v0", overrides={"arrival_rate": 1e30}, profile={})
@example(name="Batching-v0", overrides={"slo_s": 10.0}, profile={"c0": 1e30})
def test_property_make_overrides_and_profiles(name, overrides, profile):
    """Every draw is refused naming a drawn field, or runs 50 vmapped steps finite with
    arrivals = completed + in system + dropped."""
    n = 1 if name == "Batching-v0" else 2
    kw = {"max_steps_in_episode": 64, **overrides}
    prof = {"queue_cap": 8, "max_batch": 4, **profile}  # small shapes unless drawn
    try:
        env, params = jaxserve.make(name, gpus=[GPUProfile(**prof)] * n, **kw)
    except ValueError as e:
        # A profile's bad service time can make the arrival rate too fast: named as gpus.
        names = (*overrides, *profile, *(("params.gpus",) if profile else ()))
        assert _refusal_names(e, names), (overrides, profile, str(e))
        event("refused")
        return
    event("ran")
    _check_run(env, params)


def _trace_column(values):
    a = np.asarray(values)
    return np.sort(a) if a.dtype.kind == "f" else a


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(arrival=columns(st.floats(min_value=0.0, max_value=100.0)),
       prompt=columns(st.integers(1, 5000)), output=columns(st.integers(1, 5000)),
       name=st.sampled_from(["Routing-v0", "Batching-v0"]))
# A gap float32 cannot hold (inf), and tokens past int32 (the 3e9).
@example(arrival=[0.0, 1.0, 2.0, 1e300], prompt=[10] * 4, output=[10] * 4, name="Routing-v0")
@example(arrival=[0.0, 1.0, 2.0, 3.0], prompt=[3 * 10 ** 9] * 4, output=[10] * 4,
         name="Batching-v0")
def test_property_trace_arrays(arrival, prompt, output, name):
    """`Trace` arrays from the whole range (sorted arrivals when they are floats, so that
    draws get past the order check): refused naming a `Trace` field, or replayed finite
    with every request accounted for."""
    tr = jaxserve.Trace(_trace_column([float(v) if isinstance(v, int) and not
                                       isinstance(v, bool) else v for v in arrival]),
                        np.asarray(prompt), np.asarray(output))
    gpus = [GPUProfile(queue_cap=8, max_batch=4)] * (1 if name == "Batching-v0" else 2)
    try:
        env, params = jaxserve.make(name, gpus=gpus, trace=tr, max_steps_in_episode=64)
    except ValueError as e:
        assert "Trace." in str(e), str(e)
        event("refused")
        return
    event("ran")
    _check_run(env, params)
