"""Bad input: what is accepted can neither overflow, hang nor vanish; the rest is
refused with a ValueError naming the field.

One test (or group) per case, each failing on the code before its fix:
1. token counts near 2^31 (int32 overflow in the continuous engine's never-fit check);
2. arrival rates whose gaps float32 cannot resolve (Batching-v0's arrival loop never ends) or
   that are so small the gaps are infinite;
3. float actions (1.7, -0.5, NaN, inf) counted in `info["invalid_actions"]` in every env;
4. loaders (tests/test_bad_input.py::test_damaged_* and tests/test_traces_loaders.py);
5. silent coercion of integers, booleans and strings;
6. `jaxserve-train --out DIR` on a non-empty directory that holds no run.
Then a hypothesis property test over `make` overrides, GPU profiles and `Trace` arrays.

Nine further cases, each failing on the code before its fix:
1. a request window over 2,048 (`queue_buffer=2000`, `queue_cap=4096`) failed at reset with
   "negative shift count" (the estimates' pairwise term; its values: test_continuous_load.py);
2. slot sizes above `MAX_SLOTS` (2^16) accepted;
3. an empty `PrefixTrace` failed inside numpy;
4. float `node` / `parent` arrays truncated, `full_blocks` never checked;
5. `gpus=` to an LLM env failed with a TypeError about `build_params`;
6. Batching-v0's reset arrivals in no step's `info` (and an auto-reset kept the old episode's
   queue slots);
7. Mooncake bounds reported without file and line, or as a raw OverflowError;
8. `jaxserve-eval`, `-pareto`, `-autoscale` checked `--out` only after their work;
9. Ctrl-C in `jaxserve-train` before the first chunk promised a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import jaxserve
from jaxserve.core import arrivals as A
from jaxserve.core import cluster as C
from jaxserve.core import queues as Q
from jaxserve.core.replica import ReplicaProfile, replica_profile
from jaxserve.core.types import MAX_SLOTS, MAX_TOKENS, GPUProfile
from jaxserve.envs import common
from jaxserve.envs.llm_prefix_routing import make_llm_prefix_routing
from jaxserve.evaluation.replay import replay_prefix
from jaxserve.traces.loaders import TraceFormatError
from jaxserve.traces.mooncake import load_mooncake
from jaxserve.traces.prefix import PrefixTrace, PrefixTree

ALL_ENVS = ("Routing-v0", "Batching-v0", "LLMRouting-v0", "Autoscaling-v0",
            "LLMAutoscaling-v0")


# ------------------------------------------------------------------ 1. token counts bounded

def test_case1_huge_token_trace_refused_by_name():
    # The failure as reported: 3e9 tokens were admitted and the request vanished.
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
    from jaxserve.scripts import train as train_cli

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
    from jaxserve.agents.run_dir import check_out_dir

    (tmp_path / "x").write_text("x")
    assert check_out_dir(tmp_path, resume=False, overwrite=False) is False  # library: allowed
    with pytest.raises(ValueError, match="pass --overwrite"):
        check_out_dir(tmp_path, resume=False, overwrite=False, overwrite_flag="--overwrite",
                      refuse_foreign=True)
    assert check_out_dir(tmp_path, resume=False, overwrite=True, refuse_foreign=True) is False
    assert check_out_dir(tmp_path / "new", resume=False, overwrite=False,
                         refuse_foreign=True) is False


# ----------------------------------------------------------- windows over 2,048 requests

@pytest.mark.parametrize("name, kw", [
    ("LLMRouting-v0", {"queue_buffer": 2000}),  # 2000 + 64 running slots
    ("LLMPrefixRouting-v0", {"queue_buffer": 2040}),  # 2040 + 16
    ("LLMRouting-v0", {"replicas": [replica_profile("opt13b-a100-80g", queue_cap=4096)]}),
])
def test_windows_over_2048_build_and_reset(name, kw):
    # Traced only (the failure was at trace time); test_continuous_load.py checks the values
    # of the estimates past the width where the pairwise term switches to a sorted sum.
    env, params = jaxserve.make(name, **kw)
    assert env.queue_buffer + env.max_seqs > 2048
    obs, state = jax.eval_shape(env.reset, jax.random.PRNGKey(0), params)
    assert obs.shape == env.observation_space(params).shape


# -------------------------------------------------------------------- the MAX_SLOTS bound

@pytest.mark.parametrize("name, kw, field", [
    ("Routing-v0", {"queue_buffer": MAX_SLOTS + 1}, "queue_buffer"),
    ("Batching-v0", {"queue_buffer": 2 ** 20}, "queue_buffer"),
    ("Autoscaling-v0", {"queue_buffer": 2 ** 31 - 1}, "queue_buffer"),
    ("LLMRouting-v0", {"queue_buffer": MAX_SLOTS + 1}, "queue_buffer"),
    ("LLMRouting-v0", {"max_seqs": MAX_SLOTS + 1}, "max_seqs"),
    ("LLMAutoscaling-v0", {"queue_buffer": MAX_SLOTS + 1}, "queue_buffer"),
    ("LLMPrefixRouting-v0", {"queue_buffer": MAX_SLOTS + 1}, "queue_buffer"),
])
def test_slot_sizes_over_max_slots_refused(name, kw, field):
    with pytest.raises(ValueError, match=rf"{field} must be <= 65536 \(MAX_SLOTS"):
        jaxserve.make(name, **kw)


def test_static_sizes_checked_on_replace_and_bound_accepted():
    env, _ = jaxserve.make("Routing-v0")
    with pytest.raises(ValueError, match=r"max_batch must be <= 65536 \(MAX_SLOTS"):
        env.replace_static(max_batch=MAX_SLOTS + 1)
    assert env.replace_static(queue_buffer=MAX_SLOTS).queue_buffer == MAX_SLOTS
    # Not slot counts: only int32's bound applies.
    assert env.replace_static(log_capacity=MAX_SLOTS + 1).log_capacity == MAX_SLOTS + 1


# ------------------------------------------------------------------ PrefixTrace validation

# Two replicas of 32 blocks x 16 tokens; a prefix tree that is one chain of four 64-token
# blocks; request 0 at its deepest node (256-token prompt: 4 full blocks), request 1 private.
PT_REPS = [jaxserve.ReplicaProfile(kv_blocks=32, block_size=16, max_seqs=4, queue_cap=8)] * 2


def _pt(n=2, prompt=256, node=(3, -1), full=(4, 4), parent=(-1, 0, 1, 2), depth=(1, 2, 3, 4)):
    return PrefixTrace(
        trace=jaxserve.Trace(np.arange(n, dtype=np.float64), np.full(n, prompt),
                             np.full(n, 8)),
        node=np.asarray(node), full_blocks=np.asarray(full),
        tree=PrefixTree(parent=np.asarray(parent), depth=np.asarray(depth),
                        hash_id=np.arange(len(parent)), block_tokens=64))


def _entries(pt):
    """Where a `PrefixTrace` enters: the env's builder and the replay."""
    return (lambda: make_llm_prefix_routing(replicas=PT_REPS, trace=pt),
            lambda: replay_prefix(PT_REPS, pt, np.zeros(len(np.atleast_1d(pt.node)), int)))


def test_empty_prefix_trace_refused_by_name():
    empty = _pt(n=0, node=np.zeros(0, int), full=np.zeros(0, int))
    for entry in _entries(empty):
        with pytest.raises(ValueError, match=r"PrefixTrace\.trace holds no requests"):
            entry()


@pytest.mark.parametrize("kw, match", [
    ({"node": (2.7, -1.0)}, r"PrefixTrace\.node must hold integers, got dtype float64"),
    ({"node": (True, False)}, r"PrefixTrace\.node must hold integers"),
    ({"parent": (-1.0, 0.5, 1.2, 2.9)}, r"PrefixTree\.parent must hold integers"),
    ({"depth": (1.0, 2.0, 3.0, 4.0)}, r"PrefixTree\.depth must hold integers"),
    ({"full": (4.0, 4.0)}, r"PrefixTrace\.full_blocks must hold integers"),
    ({"full": (99, -1)}, r"PrefixTrace\.full_blocks\[1\] must be >= 0, got -1"),
    ({"full": (99, 4)}, r"PrefixTrace\.full_blocks\[0\] must be prompt_tokens // block_tokens "
                        r"= 256 // 64 = 4, got 99"),
    ({"prompt": 150, "full": (2, 2)}, r"PrefixTrace\.node\[0\] \(3\) is at depth 4, but its "
                                      r"prompt has only ceil\(150 / block_tokens 64\) = 3"),
    ({"full": (4, 3)}, r"PrefixTrace\.full_blocks\[1\] must be prompt_tokens // block_tokens "
                       r"= 256 // 64 = 4, got 3"),
    ({"node": (4, -1)}, r"PrefixTrace\.node\[0\] must be -1 or a tree node in \[0, 4\)"),
    ({"node": (3, -1, 0)}, r"PrefixTrace\.node must be \(2,\)"),
    ({"parent": (-1, 0, 3, 2)}, r"PrefixTree\.parent\[2\] must be in \[-1, 2\)"),
    ({"depth": (1, 2, 2, 4)}, r"PrefixTree\.depth\[2\] must be 3"),
])
def test_prefix_trace_arrays_validated(kw, match):
    # Before: every one of these was accepted by both entries (floats truncated to ints).
    bad = _pt(**kw)
    for entry in _entries(bad):
        with pytest.raises(ValueError, match=match):
            entry()


def test_valid_prefix_traces_pass_as_int64():
    from jaxserve.traces.prefix import validate_prefix_trace  # the helper the fix added

    got = validate_prefix_trace(_pt(node=np.array([3, -1], np.int32)))
    assert got.node.dtype == np.int64 and got.tree.parent.dtype == np.int64
    np.testing.assert_array_equal(got.full_blocks, [4, 4])  # a private request: -1, 4 blocks
    # A partial deepest block: 200 tokens at the depth-4 node has 3 full blocks.
    assert validate_prefix_trace(_pt(prompt=200, full=(3, 3))).full_blocks.tolist() == [3, 3]
    # A path shorter than the full blocks: the rest are the request's own (as at node -1).
    assert validate_prefix_trace(_pt(node=(1, 0))).full_blocks.tolist() == [4, 4]


# -------------------------------------------------------------------- gpus= to an LLM env

@pytest.mark.parametrize("name", ["LLMRouting-v0", "LLMPrefixRouting-v0", "LLMAutoscaling-v0"])
@pytest.mark.parametrize("gpus", [[], [GPUProfile()]])
def test_llm_envs_refuse_gpus(name, gpus):
    with pytest.raises(ValueError, match=rf"{name} takes replicas= .*not gpus="):
        jaxserve.make(name, gpus=gpus)


# ----------------------------------------------------------------- Batching-v0's accounting

def _batching_run(env, params, steps, key=3):
    """A `step_env` rollout from `reset_env` (random actions): the reset state's pending
    counts, then per step the `info` dict, the reward and the requests in the system."""
    def run(key):
        _, state = env.reset_env(key, params)

        def body(state, k):
            k_a, k_s = jax.random.split(k)
            a = jax.random.randint(k_a, (), 0, env.num_actions)
            _, state, reward, _, info = env.step_env(k_s, state, a, params)
            return state, (info, reward, C.in_system(state.cluster))
        # (-1 where the state has no such counts, as before the fix: the identity then fails)
        pending = (getattr(state, "reset_arrived", -1), getattr(state, "reset_dropped", -1))
        return pending, jax.lax.scan(body, state, jax.random.split(key, steps))[1]

    return jax.device_get(jax.jit(run)(jax.random.PRNGKey(key)))


def _accounted(info, held):
    """Summed `info` arrivals, and completed + dropped + in system, after each step."""
    return (np.cumsum(info["arrived"]),
            np.cumsum(info["completed"]) + np.cumsum(info["dropped"]) + np.asarray(held))


def test_batching_info_counts_the_reset_arrivals():
    env, params = jaxserve.make("Batching-v0")
    _, (info, _, held) = _batching_run(env, params, 40)
    np.testing.assert_array_equal(*_accounted(info, held))  # was off by one at every step
    # Five requests at t = 0 into a queue of 2: the reset admits 2 and drops 3; the first
    # step reports all five arrivals and the three drops, but its reward does not charge
    # those drops (no action could have avoided them).
    tr = jaxserve.Trace(np.array([0.0] * 5 + [1.0, 2.0]), np.full(7, 100), np.full(7, 10))
    env, params = jaxserve.make("Batching-v0", trace=tr,
                                gpus=[GPUProfile(queue_cap=2, max_batch=2)])
    (arrived, dropped), (info, reward, held) = _batching_run(env, params, 8)
    assert (int(arrived), int(dropped)) == (5, 3)
    total, accounted = _accounted(info, held)
    np.testing.assert_array_equal(total, accounted)
    assert total[-1] == 7 and info["arrived"][0] >= 5 and info["dropped"][0] >= 3
    first = C.StepMetrics(**{k: v[0] for k, v in info.items()})
    charged = first.replace(arrived=first.arrived - 5, dropped=first.dropped - 3)
    assert float(reward[0]) == pytest.approx(float(common.reward_from(charged, params)))


def test_batching_auto_reset_keeps_the_reset_queue():
    # The auto-reset used to keep the finished episode's queue slots (it skips them for envs
    # whose reset leaves the queues empty): the new episode's first waiting request was the
    # old episode's slot 0 (its arrival, prompt and estimate), under the reset's count.
    env, params = jaxserve.make("Batching-v0", max_steps_in_episode=3)
    _, state = env.reset(jax.random.PRNGKey(0), params)
    for i in range(3):
        obs, state, _, _, trunc, _ = env.step(jax.random.PRNGKey(100 + i), state,
                                              jnp.int32(1), params)
    assert bool(trunc) and int(state.time) == 0
    # `obs` is the reset's own observation; the state must give the same one.
    np.testing.assert_allclose(env.get_obs(state, params), obs, rtol=1e-6)
    q = state.cluster.queues
    waiting = np.asarray(Q.waiting_mask(q))
    assert waiting.sum() >= 1
    np.testing.assert_allclose(np.asarray(q.estimate)[waiting].sum(), q.estimate_sum[0],
                               rtol=1e-6)


# -------------------------------------------------------------------- Mooncake bounds

def _row(t, i=10, o=5, ids=None):
    return {"timestamp": t, "input_length": i, "output_length": o,
            "hash_ids": [1] * -(-i // 512) if ids is None else ids}


@pytest.mark.parametrize("rows, line, match", [
    # Out of order on purpose: the error names the file's line, not the sorted index.
    ([_row(5), _row(0), _row(3, i=2 ** 25)], 3, r"input_length = 33554432 tokens exceeds"),
    ([_row(5), _row(0), _row(3, o=2 ** 25)], 3, r"output_length = 33554432 tokens exceeds"),
    ([_row(5), _row(0), _row(3, i=2 ** 24 - 1)], 3,
     r"input_length \+ output_length = 16777220 tokens exceeds"),
    ([_row(2e12), _row(0), _row(10)], 1,
     r"timestamp comes 2e\+09 s after the previous request \(line 3\)"),
    ([_row(0), _row(1, ids=[2 ** 63])], 2, r"hash_ids\[0\] = 9223372036854775808 is outside "
                                           r"int64"),
    ([_row(0), _row(1, ids=[-2 ** 63 - 1])], 2, r"hash_ids\[0\] = .* is outside int64"),
])
def test_mooncake_bounds_name_file_and_line(tmp_path, rows, line, match):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(TraceFormatError, match=match) as e:
        load_mooncake(path)
    assert e.value.line == line and str(e.value).startswith(f"{path}, line {line}: ")


# -------------------------------------------------------------- --out checked before work

class _WorkStarted(Exception):
    """Raised where a CLI's work would start (not a user error: run_cli lets it through)."""


def _cli(name, monkeypatch):
    """The named CLI's module, its first piece of work replaced by `_WorkStarted`."""
    from jaxserve.scripts import autoscale, evaluate, pareto

    def work(*a, **k):
        raise _WorkStarted

    if name == "pareto":
        monkeypatch.setattr(pareto.W, "make_params", work)
        return pareto
    monkeypatch.setattr(jaxserve, "make", work)
    return {"eval": evaluate, "autoscale": autoscale}[name]


@pytest.mark.parametrize("name", ["eval", "pareto", "autoscale"])
def test_out_checked_before_any_work(name, tmp_path, monkeypatch, capsys):
    cli = _cli(name, monkeypatch)
    main = cli.main
    # An existing file: refused at once (before: after all the work, by mkdir).
    f = tmp_path / "file.txt"
    f.write_text("keep")
    assert main(["--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"--out {f} exists and is not a folder" in err, err
    # Someone else's non-empty folder: refused, its files untouched.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.md").write_text("mine")
    assert main(["--out", str(other)]) == 2
    err = capsys.readouterr().err
    assert "holds files this tool does not write (notes.md)" in err and "--overwrite" in err
    assert [p.name for p in other.iterdir()] == ["notes.md"]
    # ... unless --overwrite; and an earlier run of the same tool is simply replaced.
    with pytest.raises(_WorkStarted):
        main(["--out", str(other), "--overwrite"])
    again = tmp_path / "again"
    again.mkdir()
    for n in cli.OUTPUTS:  # the files the tool writes
        (again / n).write_text("old")
    with pytest.raises(_WorkStarted):
        main(["--out", str(again)])
    with pytest.raises(_WorkStarted):
        main(["--out", str(tmp_path / "new" / "dir")])
    assert (tmp_path / "new" / "dir").is_dir()


# ------------------------------------------------------------ Ctrl-C before the first chunk

def test_interrupt_before_a_checkpoint_says_so(tmp_path, monkeypatch, capsys):
    from jaxserve import agents
    from jaxserve.scripts import train as train_cli

    def interrupted(*a, out_dir=None, **k):
        Path(out_dir).mkdir(parents=True, exist_ok=True)  # as agents.train does, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(agents, "train", interrupted)
    out = tmp_path / "run"
    argv = ["--out", str(out), "--total-steps", "1000", "--no-eval", "--no-progress"]
    assert train_cli.main(argv) == 130
    err = capsys.readouterr().err
    assert "no checkpoint saved yet" in err and "continue with" not in err, err
    # What it says is true: there is nothing to resume.
    assert train_cli.main(argv + ["--resume"]) == 2
    assert "--resume but there is no checkpoint" in capsys.readouterr().err
    # With a checkpoint (saved by agents.train on Ctrl-C after a chunk), it says where.
    monkeypatch.setattr(train_cli, "latest_step", lambda d: 8 if Path(d) == out /
                        "checkpoints" else None)
    assert train_cli.main(argv + ["--overwrite"]) == 130
    err = capsys.readouterr().err
    assert (f"checkpoint at update 8 in {out / 'checkpoints'}, continue with the same command "
            f"plus --resume and without --overwrite") in err, err


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
# The reported cases first: a rate float32 cannot resolve (reset never returned), a profile
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
# A gap float32 cannot hold (inf), and tokens past int32 (the reported 3e9).
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
