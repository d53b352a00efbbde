"""The benchmark harness's own machinery, `jaxserve.evaluation.benchmark` (no timing targets:
those live in `scripts/bench.py`'s runs)."""

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.evaluation import benchmark as bench


def _program(x):
    # A loop (a control-flow op whose trace event encloses its body's ops) around real work.
    return jax.lax.fori_loop(0, 7, lambda i, v: jnp.sin(v) * 1.01 + i, x)


def test_self_times_subtract_nested_events_on_the_same_thread_only():
    # Thread 1: a loop [0, 100) running two ops inside it, then an op after it; thread 2: an
    # op overlapping the loop in time, which is not nested in it.
    lines = [[(0.0, 100.0, "while.1"), (10.0, 20.0, "fusion.a"), (40.0, 20.0, "fusion.b"),
              (100.0, 5.0, "copy.c")],
             [(20.0, 30.0, "fusion.d")]]
    agg = bench.self_times(lines)
    assert agg["while.1"] == {"count": 1, "ns": 60.0}
    assert agg["fusion.a"]["ns"] == 20.0 and agg["copy.c"]["ns"] == 5.0
    assert agg["fusion.d"]["ns"] == 30.0
    # A loop inside a loop: each level loses only its direct children.
    nested = bench.self_times([[(0.0, 50.0, "while.o"), (5.0, 30.0, "while.i"),
                                (10.0, 10.0, "fusion.x")]])
    assert nested["while.o"]["ns"] == 20.0 and nested["while.i"]["ns"] == 20.0


def test_trace_of_a_compiled_program_names_its_ops():
    f = jax.jit(_program)
    x = jnp.ones((64, 64), jnp.float32)
    compiled = f.lower(x).compile()
    ops = bench.hlo_op_summary(compiled.as_text())
    assert any(v.split(" [")[0].endswith(" while") for v in ops.values())
    jax.block_until_ready(compiled(x))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready(compiled(x))
        files = sorted(Path(d).rglob("*.xplane.pb"))
        assert files
        agg = bench.aggregate_trace(str(files[0]))
    assert any(k.startswith("while") for k in agg), sorted(agg)
    assert set(agg) <= set(ops)  # every traced op is an instruction of the compiled module
    # The loop's body ran once per iteration (7), each op its own event.
    assert sum(a["count"] for k, a in agg.items() if not k.startswith("while")) >= 7


def test_phase_of_places_ops_in_the_engine_pass():
    """Ops group by the boundary pass's named scopes and by the lane loop's level (one `while`
    body below the env's step: the dense phase; two: the compact chunks)."""
    step = "jit(run)/while/body/closed_call/vmap(jit(step))"
    assert bench.phase_of(f"s32[1024,1,64] fusion [{step}/while/body/vmap(schedule)/apply/"
                          "jit(_where)/select_n]") == ("dense", "apply")
    assert bench.phase_of(f"s32[1024,1,64] fusion [{step}/while/body/vmap(schedule)/"
                          "jit(_where)/select_n]") == ("dense", "schedule")
    # A scope name inside another word is not the phase ("apply_fn", "rescheduled").
    assert bench.phase_of(f"f32[4] add [{step}/apply_fn/rescheduled/add]") == (
        "", "rest of the step")
    assert bench.phase_of(f"s32[64,1,64] fusion [{step}/while/body/while/body/vmap(decode_run)"
                          "/while/body/jit(_where)/select_n]") == ("chunks", "decode_run")
    assert bench.phase_of(f"f32[256,4] fusion [{step}/estimates/cond/branch_4_fun/"
                          "reduce_sum]") == ("", "estimates")
    assert bench.phase_of(f"u32[4] fusion [{step}/jit(_randint)/add]") == ("", "rest of the step")
    assert bench.phase_of("u32[1024,1,64] copy") == ("", "unnamed copy")
    agg = {"a": {"count": 2, "ns": 300.0}, "b": {"count": 4, "ns": 100.0}}
    ops = {"a": f"f32[8] fusion [{step}/while/body/end_iteration/add]", "b": "f32[8] copy"}
    rows = bench.phase_summary(agg, ops, steps=2)
    assert [(r["loop"], r["phase"]) for r in rows] == [("dense", "end_iteration"),
                                                        ("", "unnamed copy")]
    assert rows[0]["share"] == 0.75 and rows[1]["per_step"] == 2.0
    assert bench.phase_summary(agg, ops, steps=2, loops=False)[0]["loop"] == ""


def test_noop_env_is_a_harness_floor_that_runs():
    env = bench.NoOpEnv()
    r = bench.time_env(env, env.default_params, num_envs=4, num_steps=3, warmup_steps=0,
                       repeats=1)
    assert r["reset_steps_per_s"] > 0 and r["arrivals_per_step"] == 0


def test_seeds_run_the_environments_under_nested_vmaps_with_the_same_results():
    """`time_env(seeds=S)` runs `vmap` over S of `vmap` over num_envs / S (PPO's multi-seed
    layout); the runner gives the same states as the flat one, and a count that S does not
    divide is refused."""
    import jaxserve
    import numpy as np
    import pytest

    env, params = jaxserve.make("Routing-v0")
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    states = jax.vmap(lambda k: env.reset(k, params)[1])(keys)
    flat = bench.make_runner(env, params, 3)(keys, states)
    nested = bench.make_runner(env, params, 3, seeds=3)(keys, states)
    for a, b in zip(jax.tree.leaves(flat), jax.tree.leaves(nested)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    r = bench.time_env(env, params, num_envs=6, num_steps=2, warmup_steps=0, repeats=1,
                       seeds=3)
    assert r["seeds"] == 3 and r["reset_steps_per_s"] > 0
    with pytest.raises(ValueError, match="divide"):
        bench.time_env(env, params, num_envs=6, num_steps=2, warmup_steps=0, seeds=4)


def test_rollout_curve_times_each_chunk_from_reset():
    env = bench.NoOpEnv()
    r = bench.rollout_curve(env, env.default_params, num_envs=4, chunk_steps=3, chunks=2)
    assert r["chunk_steps"] == 3 and len(r["steps_per_s"]) == 2
    assert all(x > 0 for x in r["steps_per_s"]) and r["compile_s"] >= 0


class _ScaledNoOp(bench.NoOpEnv):
    """NoOpEnv whose observation is scaled by a class constant read when the step is traced:
    a stand-in for a module constant such as `lanes.DENSE_FRACTION`."""

    SCALE = 1.0

    def step_env(self, key, state, action, params):
        obs, state, reward, done, info = super().step_env(key, state, action, params)
        return obs * type(self).SCALE, state, reward, done, info


def test_paired_curve_compiles_each_variant_and_alternates_chunks():
    env = _ScaledNoOp()
    seen = []

    def set_scale(v):
        seen.append(v)
        _ScaledNoOp.SCALE = v

    try:
        same = bench.paired_curve(env, env.default_params, 4, 3, 4, set_scale, (1.0, 1.0))
        diff = bench.paired_curve(env, env.default_params, 4, 3, 4, set_scale, (1.0, 2.0))
    finally:
        _ScaledNoOp.SCALE = 1.0
    assert seen == [1.0, 1.0, 1.0, 2.0]  # set before each variant's trace
    assert len(same["us_per_env_step"][0]) == len(same["us_per_env_step"][1]) == 4
    assert len(same["ratios"]) == 2 and same["min_ratio"] <= same["median_ratio"] \
        <= same["max_ratio"]
    assert same["sums"][0] == same["sums"][1] != 0.0
    # Each variant was traced with its own value (the caches were cleared in between).
    assert diff["sums"][1] == 2.0 * diff["sums"][0]


def test_bench_ab_parses_and_rejects_bad_specs():
    import jaxserve.scripts.bench as sb
    from jaxserve.core import engines

    assert sb.parse_ab("decode_runs=True, False") == ("decode_runs", (True, False))
    assert sb.parse_ab("mode='exact','one_pass'") == ("mode", ("exact", "one_pass"))
    for spec, match in (("decode_runs=True", "FIELD=A,B"),
                        ("=1,2", "FIELD=A,B"),
                        ("jaxserve.core.lanes.DENSE_FRACTION=4,2", "no longer patched"),
                        ("decode_runs=yes,no", "Python literals")):
        with pytest.raises(ValueError, match=match):
            sb.parse_ab(spec)
    # Each value becomes an engine of the environment's class, validated by it.
    assert sb.engine_variant(engines.CONTINUOUS, "decode_runs", False) == \
        engines.ContinuousEngine(decode_runs=False)
    with pytest.raises(ValueError, match="no field 'nope'"):
        sb.engine_variant(engines.CONTINUOUS, "nope", 1)
    with pytest.raises(ValueError, match="no field 'name'"):
        sb.engine_variant(engines.CONTINUOUS, "name", "x")
    with pytest.raises(ValueError, match="mode must be one of"):
        sb.engine_variant(engines.STATIC, "mode", "one_pass")
    with pytest.raises(ValueError, match="decode_runs must be a bool"):
        sb.engine_variant(engines.CONTINUOUS, "decode_runs", 0)


def test_one_pass_runs_each_lane_body_once_where_due():
    from jaxserve.core import lanes

    def cond(c, consts):  # consts: (this lane's (limit,), the shared step)
        return c[0] < consts[0][0]

    def body(c, consts, active):  # gated: unchanged where inactive
        return (c[0] + active.astype(jnp.int32) * consts[1],)

    start, limit, shared = jnp.array([0, 3, 5, 9]), jnp.array([4, 4, 5, 20]), jnp.int32(2)
    full = lanes.lane_while(cond, body, (start,), (limit,), shared)[0]
    once = lanes.one_pass(cond, body, (start,), (limit,), shared)[0]
    assert full.tolist() == [4, 5, 5, 21]  # the loop runs each lane until its test fails
    assert once.tolist() == [2, 5, 5, 11]  # one gated trip: lane 2 (not due) unchanged
    batched = jax.vmap(lambda s: lanes.one_pass(cond, body, (s,), (limit,), shared)[0])(
        jnp.stack([start, start + 1]))
    assert batched.tolist() == [[2, 5, 5, 11], [3, 4, 6, 12]]


def test_env_with_engine_is_the_seam_for_engine_variants():
    """`env.with_engine(engine)`: the same environment on another configuration of its engine
    (what bench's --ceiling, --profile and --ab time), part of the environment's identity;
    `mode="off"` leaves the cluster as routed, `"one_pass"` runs at most one boundary pass
    per step, and an engine of the other class is refused."""
    import jaxserve
    from jaxserve.core import engines

    env, params = jaxserve.make("LLMRouting-v0")
    off = env.with_engine(engines.ContinuousEngine(mode="off"))
    one = env.with_engine(engines.ContinuousEngine(mode="one_pass"))
    assert off.ENGINE.mode == "off" and env.ENGINE is engines.CONTINUOUS
    assert off != env and hash(off) != hash(env) and off.static == env.static
    assert env.with_engine(engines.ContinuousEngine()) == env  # equal engines, one program
    assert off.replace_static(log_capacity=4).ENGINE == off.ENGINE
    with pytest.raises(ValueError, match="runs a ContinuousEngine"):
        env.with_engine(engines.STATIC)
    with pytest.raises(ValueError, match="mode must be one of"):
        engines.ContinuousEngine(mode="fast")

    def roll(e, n=12):
        _, state = e.reset(jax.random.PRNGKey(0), params)
        boundaries = []
        for i in range(n):
            _, state, _, _, _, info = e.step(jax.random.PRNGKey(i + 1), state, i % 4, params)
            boundaries.append(int(info["boundaries"]))
        return state, boundaries

    s_off, b_off = roll(off)
    assert int(s_off.cluster.iterations.sum()) == 0 and b_off == [0] * 12
    assert int(s_off.cluster.queues.count.sum()) == 12  # routed, never served
    _, b_one = roll(one)
    _, b_exact = roll(env)
    assert max(b_one) == 1 and max(b_exact) > 1


def test_bench_ceiling_rejects_a_single_chunk():
    import jaxserve.scripts.bench as sb

    with pytest.raises(SystemExit):
        sb.main(["--ceiling", "--curve", "1", "--num-envs", "4"])


def test_paired_curve_variant_may_time_its_own_environment():
    env = _ScaledNoOp()

    def set_variant(v):  # A: the scaled env (class constant 2); B: a plain NoOpEnv
        _ScaledNoOp.SCALE = 2.0
        return None if v == "scaled" else (bench.NoOpEnv(), env.default_params)

    try:
        r = bench.paired_curve(env, env.default_params, 4, 3, 2, set_variant,
                               ("scaled", "plain"))
    finally:
        _ScaledNoOp.SCALE = 1.0
    assert r["sums"][0] == 2.0 * r["sums"][1] != 0.0


def test_bench_slots_rejects_bad_widths():
    import jaxserve.scripts.bench as sb

    for spec in ("64", "0", "32,x"):
        with pytest.raises(SystemExit):
            sb.main(["--slots", spec, "--num-envs", "4"])


def test_rollout_tally_stacks_each_steps_tally_of_the_timed_program():
    env = bench.NoOpEnv()
    times = bench.rollout_tally(env, env.default_params, 4, 3, lambda state, info: state.time)
    assert times.shape == (3, 4) and (np.diff(times, axis=0) >= 0).all()
    # The same program as the timed chunks: its final states and summed observations agree
    # (NoOpEnv's observation is 51 copies of the action, its state the summed actions).
    chunk = bench._rollout_chunk(env, env.default_params, 4, 3)
    states, acc = jax.jit(chunk)(jax.random.PRNGKey(1),
                                 bench.reset_states(env, env.default_params, 4))
    assert np.array_equal(np.asarray(states.time), times[-1])
    assert float(acc) == 51.0 * times[-1].sum()
