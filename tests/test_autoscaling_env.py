"""Autoscaling-v0: features and info, GPU-second accounting, warm-up, draining, diurnal load (the
gymnax contract is tests/test_env_contract.py's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.core.profiles import get_profile
from jaxserve.core.service import batch_service_time
from jaxserve.envs import autoscaling as AS


def small(**kw):
    kw.setdefault("max_replicas", 3)
    kw.setdefault("max_steps_in_episode", 16)
    kw.setdefault("arrival_rate", 0.6)
    return jaxserve.make("Autoscaling-v0", **kw)


def rollout(env, params, key, num_steps, actions=None):
    """Scans `num_steps` steps of random (or the given per-step) actions."""
    obs, state = env.reset(key, params)

    def step(state, x):
        k, a = x
        k_a, k_s = jax.random.split(k)
        a = jnp.where(a < 0, env.action_space(params).sample(k_a), a)
        obs, state, r, term, trunc, info = env.step(k_s, state, a, params)
        return state, (obs, r, term, trunc, info)

    acts = -jnp.ones((num_steps,), jnp.int32) if actions is None else jnp.asarray(actions)
    return jax.lax.scan(step, state, (jax.random.split(key, num_steps), acts))


run = jax.jit(rollout, static_argnums=(0, 3))


def trace_of(times, prompt, output):
    n = len(times)
    return jaxserve.Trace(arrival_s=np.asarray(times, float), prompt_tokens=np.full(n, prompt),
                          output_tokens=np.full(n, output))


def test_features_actions_and_info_keys():
    """Autoscaling-v0's own shapes and info keys; the gymnax contract (step outputs, jit,
    vmap over environments and parameters equal to a loop, truncation after
    max_steps_in_episode, auto-reset) is tests/test_env_contract.py's."""
    env, params = small()
    obs, state = env.reset(jax.random.key(0), params)
    assert obs.shape == (AS.NUM_FEATURES,) == (len(env.FEATURES),)
    assert env.observation_space(params).contains(obs)
    assert env.num_actions == 3 and env.action_space(params).n == 3
    out = env.step(jax.random.key(1), state, jnp.int32(2), params)
    assert len(out) == 6
    obs, state, reward, terminated, truncated, info = out
    assert reward.dtype == jnp.float32 and obs.dtype == jnp.float32
    assert {"gpu_seconds", "active", "serving", "provisioned", "slo_violations",
            "final_observation"} <= set(info)


def test_vmap_over_prices_changes_only_the_cost_term():
    env, params = small()
    prices = jnp.asarray([0.0, 1.0, 10.0], jnp.float32)
    batched = params.replace(gpu_price=prices)
    acts = jnp.asarray([2, 0, 1, 2, 2, 0, 1, 1], jnp.int32)
    axes = jax.tree.map(lambda _: None, params).replace(gpu_price=0)
    _, (_, r, _, _, info) = jax.vmap(lambda p: rollout(env, p, jax.random.key(4), 8, acts),
                                     in_axes=(axes,))(batched)
    scale = float(params.serving.latency_scale)
    for i in range(1, 3):
        expect = r[0] - float(prices[i]) * info["gpu_seconds"][0] / scale
        np.testing.assert_allclose(r[i], expect, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(info["completed"][i], info["completed"][0])


def test_reward_is_the_documented_cost():
    env, params = small(gpu_price=3.0, slo_penalty_s=50.0, latency_weight=0.5, slo_s=5.0,
                        arrival_rate=2.0)
    _, (_, r, _, _, info) = run(env, params, jax.random.key(5), 12)
    cost = (0.5 * info["in_system_time"] + 50.0 * info["slo_violations"]
            + float(params.serving.drop_penalty_s) * info["dropped"] + 3.0 * info["gpu_seconds"])
    np.testing.assert_allclose(r, -cost / float(params.serving.latency_scale), rtol=1e-5)
    assert int(info["slo_violations"].sum()) > 0


def test_gpu_seconds_integral_with_a_drain():
    """Two replicas each run a batch of two long requests; one drains at the next decision and
    is released at its batch's end: GPU-seconds = 3 intervals x 1 replica + that end time."""
    gpu = get_profile("mid")
    dt = 15.0
    env, params = jaxserve.make("Autoscaling-v0", gpu=gpu, max_replicas=2, initial_replicas=2,
                                control_interval_s=dt, warmup_s=0.0,
                                trace=trace_of([0.0] * 4, 100, 1000), max_steps_in_episode=10)
    s = float(batch_service_time(gpu, 2, 200.0, 2 * 100.0 ** 2, 1000.0))
    assert 2 * dt < s < 3 * dt  # the batch ends in the third interval
    _, (_, _, term, _, info) = run(env, params, jax.random.key(0), 3, jnp.asarray([1, 0, 0]))
    gpu_s = np.asarray(info["gpu_seconds"])
    np.testing.assert_allclose(gpu_s[0], 2 * dt, rtol=1e-6)
    np.testing.assert_allclose(gpu_s.sum(), 3 * dt + s, rtol=1e-5)
    assert info["provisioned"].tolist() == [2, 2, 1]
    assert bool(term[2]) and int(info["completed"].sum()) == 4


def test_warmup_delays_service_but_not_cost_and_cancel_is_free():
    dt, warm = 15.0, 30.0
    times = np.arange(0.0, 90.0, 1.0) + 0.5
    env, params = jaxserve.make("Autoscaling-v0", max_replicas=3, initial_replicas=1,
                                control_interval_s=dt, warmup_s=warm,
                                trace=trace_of(times, 64, 400), max_steps_in_episode=10)
    _, state = env.reset(jax.random.key(0), params)
    served_new = []
    for i, a in enumerate([1, 1, 1, 1]):
        _, state, _, _, _, info = env.step(jax.random.key(i + 1), state, jnp.int32(a), params)
        assert float(info["gpu_seconds"]) == pytest.approx(2 * dt)
        served_new.append(int(state.cluster.servers.batches[1]))
        c = AS.counts(state)
        assert int(c["provisioned"]) == 2
    # The new replica takes requests only once warmed up (after 30 s = 2 intervals).
    assert served_new[0] == 0 and served_new[1] == 0 and served_new[3] > 0
    # Scale up by two then cancel both before they are warm: cancelled replicas cost nothing.
    _, state = env.reset(jax.random.key(0), params)
    _, state, *_ = env.step(jax.random.key(1), state, jnp.int32(2), params)
    assert int(AS.counts(state)["warming"]) == 2
    _, state, _, _, _, info = env.step(jax.random.key(2), state, jnp.int32(0), params)
    assert float(info["gpu_seconds"]) == pytest.approx(dt)
    assert int(AS.counts(state)["warming"]) == 0 and int(AS.counts(state)["draining"]) == 0


def test_invariants_under_random_scaling_and_overload():
    """At 10x overload with random actions: a replica always serves, requests are conserved,
    every output is finite, and the time-of-day clock stays in [0, period) (float32)."""
    env, params = small(arrival_rate=6.0, max_steps_in_episode=5000, diurnal_period_s=600.0,
                        warmup_s=40.0)
    state, (obs, r, _, _, info) = run(env, params, jax.random.key(7), 300)
    assert np.isfinite(np.asarray(obs)).all() and np.isfinite(np.asarray(r)).all()
    assert int(info["dropped"].sum()) > 0
    assert (np.asarray(info["serving"]) >= 1).all()
    assert (np.asarray(info["active"]) >= 1).all()
    cl = state.cluster
    in_system = int((cl.queues.count + cl.servers.run_count).sum())
    assert int(info["arrived"].sum()) == (int(info["completed"].sum())
                                          + int(info["dropped"].sum()) + in_system)
    assert 0.0 <= float(state.clock) < 600.0
    gpu_s = np.asarray(info["gpu_seconds"])
    prov_hi = np.concatenate([[1], np.asarray(info["provisioned"])[:-1]]) + 3  # loose bound
    assert (gpu_s >= 0).all() and (gpu_s <= prov_hi * 15.0 + 1e-3).all()
    assert (np.asarray(info["invalid_actions"]) == 0).all()
    assert env.observation_space(params).contains(obs[-1])


def test_invalid_actions_are_clipped_and_counted():
    env, params = small()
    _, state = env.reset(jax.random.key(0), params)
    _, state, _, _, _, info = env.step(jax.random.key(1), state, jnp.int32(99), params)
    assert int(info["invalid_actions"]) == 1 and int(info["active"]) == 3
    _, state, _, _, _, info = env.step(jax.random.key(2), state, jnp.int32(-5), params)
    assert int(info["invalid_actions"]) == 1 and int(info["active"]) == 1


def test_diurnal_arrival_counts_follow_the_rate():
    """Mean arrivals per interval at each time of day match base * (1 + a sin) * dt.

    8 envs x 5 periods = 40 samples per phase of ~15-45 Poisson arrivals; each phase mean is
    checked within 5 standard errors (a false failure has probability < 1e-4 over 40 phases).
    """
    base, amp, period, dt = 2.0, 0.5, 600.0, 15.0
    env, params = small(arrival_rate=base, diurnal_amplitude=amp, diurnal_period_s=period,
                        control_interval_s=dt, max_replicas=8, max_steps_in_episode=10_000)
    steps = int(5 * period / dt)
    keys = jax.random.split(jax.random.key(11), 8)
    _, (_, _, _, _, info) = jax.jit(jax.vmap(  # jitted: one program, no op-by-op reset
        lambda k: rollout(env, params, k, steps, jnp.full((steps,), 7, jnp.int32))))(keys)
    counts = np.asarray(info["arrived"], float).reshape(8, 5, -1)  # env, period, phase
    per_phase = counts.reshape(40, -1)
    clock = np.arange(per_phase.shape[1]) * dt
    expect = base * (1 + amp * np.sin(2 * np.pi * clock / period)) * dt
    se = np.sqrt(expect / per_phase.shape[0])
    assert np.all(np.abs(per_phase.mean(0) - expect) < 5 * se)


@pytest.mark.parametrize("bad, match", [
    (dict(diurnal_amplitude=1.0), "diurnal_amplitude"),
    (dict(initial_replicas=9), "initial_replicas"),
    (dict(control_interval_s=0.0), "control_interval_s"),
    (dict(gpu_price=-1.0), "gpu_price"),
    (dict(bogus=1), "bogus"),
])
def test_bad_parameters_raise_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        jaxserve.make("Autoscaling-v0", **bad)


def test_trace_rejects_a_diurnal_cycle():
    with pytest.raises(ValueError, match="diurnal_amplitude"):
        jaxserve.make("Autoscaling-v0", trace=trace_of([0.0, 1.0], 10, 10),
                      diurnal_amplitude=0.3)


def test_delta_action_mode_and_action_for_target():
    env, params = small(max_replicas=8, initial_replicas=2, action_mode=1)
    _, state = env.reset(jax.random.key(0), params)
    # action a changes the active count by a - 4.
    _, state, _, _, _, info = env.step(jax.random.key(1), state, jnp.int32(6), params)
    assert int(info["active"]) == 4 and int(info["invalid_actions"]) == 0
    _, state, _, _, _, info = env.step(jax.random.key(2), state, jnp.int32(3), params)
    assert int(info["active"]) == 3
    _, state, _, _, _, info = env.step(jax.random.key(3), state, jnp.int32(0), params)
    assert int(info["active"]) == 1 and int(info["invalid_actions"]) == 1  # asked for -1
    for mode in (0, 1):
        p = params.replace(action_mode=jnp.int32(mode))
        for target in (1, 5, 8):
            a = AS.action_for_target(target, state, p, 8)
            got, bad = AS.target_from_action(a, state, p, 8)
            want = target if mode == 0 else min(target, 1 + 3)  # delta mode: at most +3
            assert int(got) == want and not bool(bad)


def test_named_trace_workloads():
    from jaxserve.envs import autoscaling_workloads as W
    from jaxserve.traces import find

    with pytest.raises(ValueError, match="unknown Autoscaling-v0 workload"):
        jaxserve.make("Autoscaling-v0", workload="nope")
    with pytest.raises(ValueError, match="load"):
        jaxserve.make("Autoscaling-v0", load=0.3)
    if find(W.TRACE_FILES["azure_code"]) is None:
        pytest.skip("azure_llm_2023_code not available (set JAXSERVE_TRACES_DIR or run "
                    "`jaxserve-traces fetch azure_llm_2023_code`)")
    with pytest.raises(ValueError, match="sets the arrivals"):
        jaxserve.make("Autoscaling-v0", workload="azure_code", arrival_rate=1.0)
    env, params = jaxserve.make("Autoscaling-v0", workload="azure_code", load=0.2)
    assert int(params.serving.trace.length) == 8819 and env.trace_len == 8819
    assert float(params.diurnal_amplitude) == 0.0
    _, (_, r, term, _, info) = run(env, params, jax.random.key(0), 4)
    assert int(info["arrived"].sum()) > 0 and np.isfinite(np.asarray(r)).all()
    env2, params2 = jaxserve.make("Autoscaling-v0", workload="azure_code_mmpp", load=0.2)
    assert env2.trace_len == 0 and params2.serving.arrivals.rates.shape == (2,)
    # The train / test parts split the same stretched replay: disjoint, together the whole.
    from jaxserve.core.sources import params_trace
    parts = [params_trace(jaxserve.make("Autoscaling-v0", workload=f"azure_code_{p}",
                                        load=0.2)[1].serving) for p in W.PARTS]
    whole = params_trace(params.serving)
    assert len(parts[0]) == round(8819 * W.TRAIN_FRACTION) and sum(map(len, parts)) == 8819
    np.testing.assert_allclose(parts[1].arrival_s + whole.arrival_s[len(parts[0])],
                               whole.arrival_s[len(parts[0]):], rtol=1e-9, atol=1e-6)


def test_random_phase_spreads_the_time_of_day_per_key():
    # random_phase=1: the reset clock is a function of the key alone (vmappable, repeatable),
    # spread over the whole cycle; random_phase=0 keeps every episode at diurnal_phase_s.
    env, params = small(diurnal_phase_s=600.0)
    keys = jax.random.split(jax.random.key(3), 64)
    clock = lambda p: jax.vmap(lambda k: env.reset(k, p)[1].clock)(keys)  # noqa: E731
    np.testing.assert_array_equal(clock(params), np.full(64, 600.0, np.float32))
    rnd = params.replace(random_phase=jnp.int32(1))
    c = np.asarray(clock(rnd))
    np.testing.assert_array_equal(c, np.asarray(clock(rnd)))
    period = float(params.diurnal_period_s)
    assert (c >= 0).all() and (c < period).all()
    # 64 uniform draws: each quarter of the day holds one with probability 1 - 0.75^64.
    assert len(np.unique((c // (period / 4)).astype(int))) == 4
    # The observation's time-of-day features follow the clock.
    obs = jax.vmap(lambda k: env.reset(k, rnd)[0])(keys)
    day_sin = np.asarray(obs[:, env.FEATURES.index("day_sin")])
    np.testing.assert_allclose(day_sin, (1 + np.sin(2 * np.pi * c / period)) / 2, atol=1e-5)
    with pytest.raises(ValueError, match="random_phase"):
        env.check_params(params.replace(random_phase=jnp.int32(2)))


def test_random_initial_and_invalid_penalty():
    env, params = small(max_replicas=4, initial_replicas=2, action_mode=1)
    keys = jax.random.split(jax.random.key(5), 64)
    # Jitted, one program each for every call below (op by op, each eager step compiled its
    # own event-loop programs).
    active = jax.jit(jax.vmap(lambda k, p: (env.reset(k, p)[1].mode == AS.ACTIVE).sum(),
                              in_axes=(0, None)))
    n0 = lambda p: np.asarray(active(keys, p))  # noqa: E731
    assert (n0(params) == 2).all()
    n = n0(params.replace(random_initial=jnp.int32(1)))
    assert set(n.tolist()) == {1, 2, 3, 4}  # 64 draws of 4 values: each missing w.p. < 1e-7
    # A clipped step costs exactly invalid_penalty_s more, same key, same everything else.
    _, state = env.reset(jax.random.key(0), params)
    step = jax.jit(env.step_env)

    def reward(p, a):
        return float(step(jax.random.key(1), state, jnp.int32(a), p)[2])
    pen = params.replace(invalid_penalty_s=jnp.float32(250.0))
    scale = float(params.serving.latency_scale)
    assert reward(pen, 3) == reward(params, 3)  # action 3 steps +1 (a - 2): 2 -> 3, valid
    full = state.replace(mode=jnp.full((4,), AS.ACTIVE, jnp.int32))
    r = lambda p, a: float(step(jax.random.key(1), full, jnp.int32(a), p)[2])  # noqa
    assert r(pen, 3) == pytest.approx(r(params, 3) - 250.0 / scale, abs=1e-6)  # 4 -> 5: clipped
    with pytest.raises(ValueError, match="random_initial"):
        env.check_params(params.replace(random_initial=jnp.int32(3)))


def test_price_spread_draws_a_price_per_episode_charged_and_observed():
    env, params = small()
    spread = params.replace(price_spread=jnp.float32(4.0))
    keys = jax.random.split(jax.random.key(7), 64)
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))  # one program for both params
    _, s1 = reset(keys, params)
    obs, s4 = reset(keys, spread)
    np.testing.assert_array_equal(s1.gpu_price, 4.0)  # spread 1: exactly gpu_price
    u = np.log(np.asarray(s4.gpu_price) / 4.0) / np.log(4.0)  # log-uniform in [1, 16]
    assert (np.abs(u) <= 1 + 1e-6).all() and (u < -0.5).any() and (u > 0.5).any()
    i = env.FEATURES.index("price")
    np.testing.assert_allclose(obs[:, i], s4.gpu_price / (1 + s4.gpu_price), rtol=1e-6)
    # Same requests (common random numbers); only the price term of the reward moves.
    step = jax.jit(jax.vmap(env.step_env, in_axes=(0, 0, None, None)))
    _, _, r1, _, i1 = step(keys, s1, jnp.int32(2), params)
    _, _, r4, _, i4 = step(keys, s4, jnp.int32(2), spread)
    np.testing.assert_array_equal(i1["arrived"], i4["arrived"])
    scale = float(params.serving.latency_scale)
    np.testing.assert_allclose(r4 - r1, -(s4.gpu_price - 4.0) * i1["gpu_seconds"] / scale,
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="price_spread"):
        env.check_params(params.replace(price_spread=jnp.float32(0.5)))


def test_random_offset_starts_a_trace_at_a_drawn_row():
    trace = trace_of(np.arange(40.0) * 3.0, 100, 50)
    env, params = jaxserve.make("Autoscaling-v0", max_replicas=2, trace=trace)
    keys = jax.random.split(jax.random.key(8), 32)
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
    _, s0 = reset(keys, params)
    _, s1 = reset(keys, params.replace(random_offset=1))
    assert (np.asarray(s0.trace_pos) == 0).all()
    pos = np.asarray(s1.trace_pos)
    assert pos.min() >= 0 and pos.max() < 40 and len(set(pos)) > 10
    np.testing.assert_array_equal(s1.upcoming.arrival, 0.0)  # the drawn row arrives at once
    # From row k, an interval of 15 s sees rows k.. at 3 s spacing: 5 arrivals (fewer at the end).
    _, st, _, _, info = jax.jit(jax.vmap(env.step_env, in_axes=(0, 0, None, None)))(
        keys, s1, jnp.int32(1), params.replace(random_offset=1))
    np.testing.assert_array_equal(info["arrived"], np.minimum(5, 40 - pos))
