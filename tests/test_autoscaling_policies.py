"""Baseline autoscalers (fixed, hpa, knative, ray_serve) on Autoscaling-v0.

Rollout properties are checked on one compiled program: every policy configuration is rolled
out (`lax.scan`) on a step-load scenario (low -> high -> low Poisson rate) and on a fast,
deep diurnal cycle, all vmapped together through `lax.switch` on the policy index. The
recommendation arithmetic is checked on hand-built `history` arrays.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve import policies as P
from jaxserve.core import arrivals as A
from jaxserve.core.profiles import get_profile
from jaxserve.envs import autoscaling as AS
from jaxserve.policies import autoscaling as PA

H = AS.H
T = 64            # control intervals per episode
DT = 15.0         # control interval (s), the env default
STEP_ON, STEP_OFF = 4, 16   # high load on steps [STEP_ON, STEP_OFF) of the step scenario
B = 8             # max_batch of the test replicas
GPU = get_profile("mid", max_batch=B, queue_cap=24)

AUTOSCALERS = ("fixed", "hpa", "knative", "ray_serve")

# (label, policy name, options); bounds default to [1, 4] unless given.
CONFIGS = (
    ("fixed", "fixed", dict(replicas=3)),
    ("hpa", "hpa", dict()),
    ("hpa_cooldown", "hpa", dict(cooldown_s=90.0, scale_down_stabilization_s=0.0)),
    ("knative", "knative", dict()),
    ("ray_b", "ray_serve", dict(target_ongoing_requests=None, downscale_delay_s=120.0)),
    ("ray", "ray_serve", dict()),
    ("fixed_2_3", "fixed", dict(replicas=2, min_replicas=2, max_replicas=3)),
    ("hpa_2_3", "hpa", dict(min_replicas=2, max_replicas=3, cooldown_s=45.0)),
    ("knative_2_3", "knative", dict(min_replicas=2, max_replicas=3)),
    ("ray_2_3", "ray_serve", dict(min_replicas=2, max_replicas=3, target_ongoing_requests=4.0,
                                  downscale_delay_s=60.0)),
)
SCENARIOS = ("step", "diurnal")   # target actions (the env default)
DELTA = "step_delta"              # the step scenario with the env's delta actions


def make_env(**kw):
    kw.setdefault("max_replicas", 4)
    return jaxserve.make("Autoscaling-v0", gpu=GPU, max_steps_in_episode=T + 1, warmup_s=30.0,
                         **kw)


@pytest.fixture(scope="module")
def env():
    return make_env(arrival_rate=0.05, initial_replicas=1)[0]


@pytest.fixture(scope="module")
def rollouts(env):
    """{(label, scenario): dict of numpy arrays over the T steps} and the policies."""
    _, p_lo = make_env(arrival_rate=0.05, initial_replicas=1)
    p_hi = p_lo.replace(serving=p_lo.serving.replace(arrivals=A.poisson(2.5)))
    _, p_di = make_env(arrival_rate=1.0, diurnal_amplitude=0.95, diurnal_period_s=300.0,
                       initial_replicas=2)
    policies = [P.get(name, env=env, **opts) for _, name, opts in CONFIGS]
    fns = [p.fn for p in policies]

    # step_env: no auto-reset needed (the episode is longer than the scan).
    def run(idx, key, p_a, p_b, high):
        obs, state = env.reset_env(key, p_a)

        def step(carry, hi):
            obs, state, k = carry
            k, k_pol, k_env = jax.random.split(k, 3)
            prm = jax.tree.map(lambda a, b: jnp.where(hi, b, a), p_a, p_b)
            a = jax.lax.switch(idx, fns, k_pol, obs, state, prm)
            obs, state, _, _, info = env.step_env(k_env, state, a, prm)
            return (obs, state, k), {"action": a, "active": info["active"],
                                     "serving": info["serving"],
                                     "invalid": info["invalid_actions"],
                                     "record": state.history[0], "time": state.time}

        return jax.lax.scan(step, (obs, state, key), high)[1]

    combos = [(i, s) for s in SCENARIOS + (DELTA,) for i in range(len(CONFIGS))]
    step_high = np.array([STEP_ON <= t < STEP_OFF for t in range(T)])
    delta = lambda p: p.replace(action_mode=jnp.int32(AS.DELTA))  # noqa: E731
    pick = {"step": (p_lo, p_hi, step_high), "diurnal": (p_di, p_di, np.zeros(T, bool)),
            DELTA: (delta(p_lo), delta(p_hi), step_high)}
    stack = lambda trees: jax.tree.map(lambda *x: jnp.stack(x), *trees)  # noqa: E731
    idx = jnp.asarray([i for i, _ in combos])
    keys = jax.random.split(jax.random.PRNGKey(7), len(combos))
    p_a = stack([pick[s][0] for _, s in combos])
    p_b = stack([pick[s][1] for _, s in combos])
    high = jnp.asarray(np.stack([pick[s][2] for _, s in combos]))
    out = jax.device_get(jax.jit(jax.vmap(run))(idx, keys, p_a, p_b, high))
    res = {}
    for n, (i, s) in enumerate(combos):
        r = {k: np.asarray(v[n]) for k, v in out.items()}
        r["initial"] = 2 if s == "diurnal" else 1
        r["policy"] = policies[i]
        res[(CONFIGS[i][0], s)] = r
    return res


def _changes(r):
    """Steps whose decision changed the active count, with the count before each step."""
    before = np.concatenate([[r["initial"]], r["active"][:-1]])
    return before, np.flatnonzero(r["active"] != before)


# ----------------------------------------------------------------------------- registry

def test_registered_and_listed():
    assert set(AUTOSCALERS) <= set(P.names("autoscaling"))
    for name in AUTOSCALERS:
        assert P.kind_of(name) == "autoscaling"


def test_invalid_options_name_the_option(env):
    bad = [
        ("fixed", dict(replicas=0), "replicas"),
        ("fixed", dict(replicas=5), "replicas"),
        ("hpa", dict(target_utilization=0.0), "target_utilization"),
        ("hpa", dict(tolerance=-0.1), "tolerance"),
        ("hpa", dict(cooldown_s=-1.0), "cooldown_s"),
        ("hpa", dict(scale_up_pods=1.5), "scale_up_pods"),
        ("hpa", dict(scale_down_percent=150.0), "scale_down_percent"),
        ("hpa", dict(scale_down_stabilization_s=float("nan")), "scale_down_stabilization_s"),
        ("knative", dict(max_scale_down_rate=1.0), "max_scale_down_rate"),
        ("knative", dict(target_concurrency=0.0), "target_concurrency"),
        ("knative", dict(panic_threshold_percentage=-5.0), "panic_threshold_percentage"),
        ("ray_serve", dict(upscale_delay_s=-1.0), "upscale_delay_s"),
        ("ray_serve", dict(target_ongoing_requests="two"), "target_ongoing_requests"),
        ("ray_serve", dict(downscaling_factor=0.0), "downscaling_factor"),
    ]
    for name, opts, option in bad:
        with pytest.raises(ValueError, match=option):
            P.get(name, env=env, **opts)
    for name in AUTOSCALERS:
        with pytest.raises(ValueError, match="max_replicas"):
            P.get(name)  # no env: max_replicas is required
        with pytest.raises(ValueError, match="max_replicas"):
            P.get(name, env=env, max_replicas=5)  # more than the env's slots
        with pytest.raises(ValueError, match="min_replicas"):
            P.get(name, env=env, min_replicas=3, max_replicas=2)
        with pytest.raises(ValueError, match="min_replicas"):
            P.get(name, env=env, min_replicas=0)
        with pytest.raises(ValueError, match="takes no option"):
            P.get(name, env=env, nope=1)
    # Windows longer than the history the env keeps are refused, naming the option.
    short, _ = make_env(arrival_rate=0.05, history_len=8)
    with pytest.raises(ValueError, match="scale_down_stabilization_s"):
        P.get("hpa", env=short)
    with pytest.raises(ValueError, match="downscale_delay_s"):
        P.get("ray_serve", env=short)
    P.get("hpa", env=short, scale_down_stabilization_s=60.0)  # 4 intervals fit
    P.get("knative", env=short)
    # Without env, explicit bounds suffice.
    assert P.get("hpa", max_replicas=4).info["max_replicas"] == 4


# ----------------------------------------------------------------------------- rollouts

def test_bounds_and_valid_actions(rollouts):
    for (label, scenario), r in rollouts.items():
        info = r["policy"].info
        lo, hi = info["min_replicas"], info["max_replicas"]
        assert r["invalid"].sum() == 0, (label, scenario)
        if scenario == DELTA:
            # One step of at most -2..+1 per decision: the bounds hold once reached.
            a = r["active"][np.argmax(r["active"] >= lo):]
        else:
            a = r["active"]
            assert np.all(a == r["action"] + 1), (label, scenario)
        assert np.all((a >= lo) & (a <= hi)), (label, scenario, r["active"])
    # Delta actions track the targets: the fixed policy reaches its count and holds it.
    assert np.all(rollouts[("fixed", DELTA)]["active"][2:] == 3)
    assert rollouts[("knative", DELTA)]["active"].max() == 4


def test_rollouts_exercise_scaling(rollouts):
    # The scenarios make every autoscaler move both ways (else the properties are vacuous).
    for label in ("hpa", "hpa_cooldown", "knative", "ray_b", "hpa_2_3", "knative_2_3", "ray_2_3"):
        before, ch = _changes(rollouts[(label, "step")])
        a = rollouts[(label, "step")]["active"]
        assert np.any(a[ch] > before[ch]) and np.any(a[ch] < before[ch]), label
    for label in ("hpa_cooldown", "knative", "knative_2_3"):
        before, ch = _changes(rollouts[(label, "diurnal")])
        a = rollouts[(label, "diurnal")]["active"]
        assert np.any(a[ch] < before[ch]), label


def test_fixed_holds_its_count(rollouts):
    for scenario in SCENARIOS:
        assert np.all(rollouts[("fixed", scenario)]["active"] == 3)
        assert np.all(rollouts[("fixed_2_3", scenario)]["active"] == 2)


def test_hpa_cooldown(rollouts):
    for label in ("hpa_cooldown", "hpa_2_3"):
        cooldown = rollouts[(label, "step")]["policy"].info["cooldown_s"]
        for scenario in SCENARIOS:
            r = rollouts[(label, scenario)]
            before, ch = _changes(r)
            downs = 0
            for prev, t in zip(ch[:-1], ch[1:]):
                if r["active"][t] < before[t]:
                    downs += 1
                    assert (t - prev) * DT >= cooldown, (label, scenario, prev, t)
            if label == "hpa_cooldown":
                assert downs > 0, scenario


def test_hpa_scale_down_stabilisation(rollouts):
    for scenario in SCENARIOS:
        r = rollouts[("hpa", scenario)]
        before, ch = _changes(r)
        ups = [t for t in ch if r["active"][t] > before[t]]
        downs = [t for t in ch if r["active"][t] < before[t]]
        for t in downs:
            # Every scale-up's recommendation stays in the 300 s window: no scale-down before
            # it has left the window.
            last_up = max([u for u in ups if u < t], default=-10**6)
            assert (t - last_up) * DT >= 300.0, (scenario, t, last_up)
            if scenario == "step":
                assert (t - STEP_OFF) * DT >= 300.0
        if scenario == "step":
            assert downs, "the step scenario's load drop should end in a scale-down"


def _ray_expected_step(r, t, target, lo, hi, look_rows, n_up, n_down):
    """Ray Serve's decision at step t, recomputed on the host from the recorded history."""
    before, ch = _changes(r)
    cur = before[t]
    if t == 0:
        return min(max(cur, lo), hi)
    rec = r["record"]

    def desired(d):  # decision at step d >= 1: rows are the intervals d-1, d-2, ...
        rows = [d - 1 - j for j in range(look_rows) if d - 1 - j >= 0]
        total = float(np.mean(rec[rows, H["concurrency"]]))
        return min(max(math.ceil(total / target - 1e-4), lo), hi)

    last_change = max([c for c in ch if c < t], default=-10**6)

    def streak(n, sign):
        ds = range(t - n, t + 1)
        return (t - n >= 1 and t - last_change >= n + 1
                and all(sign * (desired(d) - before[d]) > 0 for d in ds))

    new = desired(t) if (streak(n_up, 1) or streak(n_down, -1)) else cur
    return min(max(new, lo), hi)


def test_ray_serve_delays_and_decisions(rollouts):
    fired = {"up": 0, "down": 0}
    for label in ("ray", "ray_b", "ray_2_3"):
        for scenario in SCENARIOS:
            r = rollouts[(label, scenario)]
            info = r["policy"].info
            target = B if info["target_ongoing_requests"] is None else \
                info["target_ongoing_requests"]
            n_up = int(info["upscale_delay_s"] // DT)
            n_down = int(info["downscale_delay_s"] // DT)
            before, ch = _changes(r)
            for t in range(T):
                want = _ray_expected_step(r, t, target, info["min_replicas"],
                                          info["max_replicas"], 2, n_up, n_down)
                assert r["active"][t] == want, (label, scenario, t, r["active"][:t + 1])
            for t in ch:
                if before[t] < info["min_replicas"]:
                    continue  # the bounds, not the rule
                prev = max([c for c in ch if c < t], default=-10**6)
                n = n_up if r["active"][t] > before[t] else n_down
                assert t >= n + 1 and t - prev >= n + 1, (label, scenario, t)
                fired["up" if r["active"][t] > before[t] else "down"] += 1
    assert fired["up"] > 0 and fired["down"] > 0


def test_knative_panics_up_and_halves_down(rollouts):
    target = 0.7 * B
    for label in ("knative", "knative_2_3"):
        for scenario in SCENARIOS:
            r = rollouts[(label, scenario)]
            lo = r["policy"].info["min_replicas"]
            before, ch = _changes(r)
            conc = r["record"][:, H["concurrency"]]
            serving = r["record"][:, H["serving"]]
            # Decision d (d >= 1) panics on the latest interval d - 1.
            trigger = np.zeros(T, bool)
            trigger[1:] = (np.ceil(conc[:-1] / target - 1e-4)
                           / np.maximum(serving[:-1], 1)) >= 2.0
            for t in ch:
                if r["active"][t] >= before[t]:
                    continue
                ready = r["serving"][t - 1] if t >= 1 else before[t]
                assert r["active"][t] >= max(lo, ready // 2), (label, scenario, t)
                # No scale-down while panicking: no trigger in the last stable window (60 s).
                assert not trigger[max(t - 4, 0):t + 1].any(), (label, scenario, t)
    # Under the step: up fast (panic: more than one replica in one decision), down slowly.
    r = rollouts[("knative", "step")]
    a = r["active"]
    assert np.max(np.diff(np.concatenate([[r["initial"]], a]))) >= 2
    t_peak = int(np.argmax(a == a.max()))
    t_bottom = STEP_OFF + int(np.argmax(a[STEP_OFF:] == 1))
    assert a.max() == 4 and a[t_bottom] == 1
    assert t_peak - STEP_ON < t_bottom - STEP_OFF


# ----------------------------------------------------------------------------- arithmetic

@pytest.fixture(scope="module")
def env8():
    return make_env(max_replicas=8, arrival_rate=0.05)


def hand_state(env, params, active, serving=None, util=None, conc=None, time=None,
               since_up=1e6, since_down=1e6):
    """An AutoscalingState whose history rows 0..k-1 (row 0 the latest) hold the given
    per-interval values; the current counts are row 0's."""
    k = len(active)
    serving = list(active) if serving is None else list(serving)
    h = np.zeros((env.history_len, len(AS.HISTORY_FIELDS)), np.float32)
    h[:k, H["active"]] = active
    h[:k, H["serving"]] = serving
    if util is not None:
        h[:k, H["utilization"]] = util
    if conc is not None:
        h[:k, H["concurrency"]] = conc
    _, state = env.reset(jax.random.PRNGKey(0), params)
    slot = jnp.arange(env.max_replicas)
    return state.replace(
        history=jnp.asarray(h), time=jnp.int32(k if time is None else time),
        mode=jnp.where(slot < active[0], AS.ACTIVE, AS.OFF).astype(jnp.int32),
        ready_at=jnp.where(slot < serving[0], 0.0, 10.0).astype(jnp.float32),
        since_scale_up=jnp.float32(since_up), since_scale_down=jnp.float32(since_down))


_JITTED = {}
NO_OBS = jnp.zeros((AS.NUM_FEATURES,), jnp.float32)  # the baselines read the state only


def decide(policy, env, params, state):
    """The replica count `policy`'s action asks for in `state` (as the env reads the action)."""
    if policy.fn not in _JITTED:
        def target(s, p):
            a = policy.fn(jax.random.PRNGKey(1), NO_OBS, s, p)
            return AS.target_from_action(a, s, p, env.max_replicas)[0]
        _JITTED[policy.fn] = jax.jit(target)
    return int(_JITTED[policy.fn](state, params))


def test_hpa_arithmetic(env8):
    env, params = env8
    hpa = P.get("hpa", env=env)
    d = lambda **kw: decide(hpa, env, params, hand_state(env, params, **kw))  # noqa: E731
    # Tolerance band |u / 0.7 - 1| <= 0.1: no change.
    assert d(active=[2], util=[0.75]) == 2
    assert d(active=[2], util=[0.65]) == 2
    # ceil(current * u / target).
    assert d(active=[2], util=[0.8]) == 3          # ceil(2.29)
    assert d(active=[4], util=[0.2]) == 2          # ceil(1.14)
    assert d(active=[3], util=[0.0]) == 1
    # No metric yet (right after reset): keep the count.
    assert d(active=[3], util=[0.0], time=0) == 3
    # Scale-up rate limit: max(+100%, +4) per 15 s.
    assert d(active=[1], util=[1.0]) == 2          # ceil(1.43)
    assert decide(P.get("hpa", env=env, target_utilization=0.1), env, params,
                  hand_state(env, params, active=[2], util=[1.0])) == 6   # not 20
    assert decide(P.get("hpa", env=env, target_utilization=0.1), env, params,
                  hand_state(env, params, active=[5], util=[1.0])) == 8   # 10, clipped
    # Unready (warming) replicas count as 0% when scaling up: with target 0.5 and u = 1,
    # ratio 2 over the ready ones, 2 * ready / active over all.
    half = P.get("hpa", env=env, target_utilization=0.5)
    h = lambda **kw: decide(half, env, params, hand_state(env, params, **kw))  # noqa: E731
    assert h(active=[4], serving=[2], util=[1.0]) == 4   # 2 * 2 / 4 = 1: within tolerance
    assert h(active=[4], serving=[3], util=[1.0]) == 6   # ceil(2 * 3), not ceil(2 * 4)
    assert h(active=[4], serving=[4], util=[1.0]) == 8
    assert h(active=[4], serving=[1], util=[0.2]) == 1   # scale-down: ceil(0.4 * 1)
    # Scale-down stabilisation: the highest recommendation of the last 300 s (20 decisions).
    for k_low in (1, 10, 19, 20, 30):
        util = [0.2] * k_low + [0.7] * (40 - k_low)
        want = 2 if k_low >= 20 else 4
        assert d(active=[4] * 40, util=util) == want, k_low
    # Only the history that exists counts.
    assert d(active=[4] * 5, util=[0.2] * 5) == 2


def test_hpa_windows_follow_the_control_interval():
    env, params = make_env(max_replicas=8, arrival_rate=0.05, control_interval_s=5.0)
    hpa = P.get("hpa", env=env, target_utilization=0.1)
    # A +2 scale-up 5 s ago (decision D_1: 2 -> 4) is inside the 15 s period: the limit
    # counts from the period's start (2): max(2 + 4, 2 * 2) = 6, not max(4 + 4, 8) = 8.
    s = hand_state(env, params, active=[4, 2, 2], util=[1.0, 0.1, 0.1])
    assert decide(hpa, env, params, s) == 6
    # 60 decisions of 5 s = 300 s of stabilisation.
    hpa = P.get("hpa", env=env)
    for k_low, want in ((59, 4), (60, 2)):
        s = hand_state(env, params, active=[4] * 64, util=[0.2] * k_low + [0.7] * (64 - k_low))
        assert decide(hpa, env, params, s) == want


def test_hpa_cooldown_arithmetic(env8):
    env, params = env8
    hpa = P.get("hpa", env=env, cooldown_s=60.0, upscale_cooldown_s=30.0)
    d = lambda **kw: decide(hpa, env, params, hand_state(env, params, **kw))  # noqa: E731
    assert d(active=[3], util=[0.1], since_down=45.0) == 3
    assert d(active=[3], util=[0.1], since_up=45.0) == 3      # any scale event
    assert d(active=[3], util=[0.1], since_down=60.0) == 1
    assert d(active=[2], util=[1.0], since_up=15.0) == 2
    assert d(active=[2], util=[1.0], since_up=30.0) == 3


def test_knative_arithmetic(env8):
    env, params = env8
    kn = P.get("knative", env=env, target_concurrency=10.0)
    d = lambda **kw: decide(kn, env, params, hand_state(env, params, **kw))  # noqa: E731
    # Stable: ceil(mean concurrency of the last 60 s / target).
    assert d(active=[2] * 4, conc=[25.0] * 4) == 3
    assert d(active=[2] * 6, conc=[25.0] * 4 + [500.0] * 2) == 3   # older than 60 s
    # Panic: the latest interval at >= 2x the ready replicas' target.
    assert d(active=[2] * 4, conc=[45.0, 5.0, 5.0, 5.0]) == 5
    # Panic counts ready replicas: 2 of 4 ready, ceil(3.5) = 4 >= 2 * 2.
    assert d(active=[4] * 4, serving=[2] * 4, conc=[35.0, 0.0, 0.0, 0.0]) == 4
    # In panic (a trigger within the last 60 s): never down.
    conc = [0.0, 0.0, 0.0, 0.0, 90.0, 0.0, 0.0]
    serving = [4, 4, 4, 4, 1, 1, 1]
    assert d(active=[4] * 7, serving=serving, conc=conc) == 4      # trigger 60 s ago
    conc2 = [0.0] * 5 + [90.0, 0.0]
    serving2 = [4] * 5 + [1, 1]
    assert d(active=[4] * 7, serving=serving2, conc=conc2) == 2    # 75 s ago: halve
    # Out of panic the count at most halves per decision (of the ready replicas).
    assert d(active=[8] * 4, conc=[0.0] * 4) == 4
    assert d(active=[5] * 4, conc=[0.0] * 4) == 2
    assert d(active=[1] * 4, conc=[0.0] * 4) == 1
    # Scale-down delay: the highest desired count of the last scale_down_delay_s.
    kd = P.get("knative", env=env, target_concurrency=10.0, scale_down_delay_s=30.0)
    s = hand_state(env, params, active=[4] * 6, conc=[0.0, 40.0, 40.0, 40.0, 40.0, 40.0])
    assert decide(kd, env, params, s) == 4   # desired 4 at D_1 (15 s ago)
    assert decide(kn, env, params, s) == 3   # without delay: ceil(30 / 10)
    # Default target: 0.7 * max_batch = 5.6 per replica.
    assert P.get("knative", env=env).info["target_concurrency"] is None
    assert decide(P.get("knative", env=env), env, params,
                  hand_state(env, params, active=[2] * 4, conc=[16.0] * 4)) == 3


def test_ray_serve_arithmetic(env8):
    env, params = env8
    ray = P.get("ray_serve", env=env, target_ongoing_requests=5.0)
    d = lambda pol=ray, **kw: decide(pol, env, params, hand_state(env, params, **kw))  # noqa
    # desired = ceil(mean ongoing requests over 30 s / target), after 3 decisions in a row.
    assert d(active=[2] * 4, conc=[30.0, 10.0, 20.0, 20.0]) == 4
    assert d(active=[2] * 4, conc=[30.0, 10.0, 0.0, 0.0]) == 2          # D_1 wanted 1
    assert d(active=[2] * 3, conc=[30.0, 10.0, 20.0], time=3) == 4
    assert d(active=[2] * 2, conc=[30.0, 10.0], time=2) == 2            # too early
    # The streak restarts at every scale event.
    assert d(active=[2] * 4, conc=[30.0, 10.0, 20.0, 20.0], since_up=30.0) == 2
    assert d(active=[2] * 4, conc=[30.0, 10.0, 20.0, 20.0], since_down=45.0) == 4
    # Downscale after 600 s: 41 decisions in a row below the current count.
    assert d(active=[4] * 41, conc=[5.0] * 41) == 1
    assert d(active=[4] * 41, conc=[5.0] * 40 + [30.0]) == 4
    assert d(active=[4] * 40, conc=[5.0] * 40) == 4
    # Smoothing factors.
    up = P.get("ray_serve", env=env, target_ongoing_requests=5.0, upscaling_factor=0.5)
    assert d(up, active=[2] * 3, conc=[20.0] * 3) == 3                  # ceil(2 * 1.5)
    down = P.get("ray_serve", env=env, target_ongoing_requests=5.0, downscaling_factor=0.1,
                 downscale_delay_s=0.0)
    assert d(down, active=[4] * 2, conc=[10.0] * 2) == 3                # stuck -> one less
    # Bounds inside the rule.
    b = P.get("ray_serve", env=env, target_ongoing_requests=1.0, max_replicas=5)
    assert d(b, active=[2] * 3, conc=[100.0] * 3) == 5
    # target None: the replica's max_batch (8).
    mb = P.get("ray_serve", env=env, target_ongoing_requests=None)
    assert d(mb, active=[1] * 3, conc=[20.0] * 3) == 3


def test_fixed_arithmetic(env8):
    env, params = env8
    assert decide(P.get("fixed", env=env, replicas=5), env, params,
                  hand_state(env, params, active=[2])) == 5
    assert decide(P.get("fixed", env=env), env, params,
                  hand_state(env, params, active=[2])) == 8   # default: max_replicas
    assert decide(P.get("fixed", max_replicas=3, replicas=3), env, params,
                  hand_state(env, params, active=[5])) == 3


def test_delta_action_mode(env8):
    # With delta actions (a step of a - 4 in -4..+3 for 8 slots) the policies step towards
    # their target.
    env, params = env8
    delta = params.replace(action_mode=jnp.int32(AS.DELTA))
    fixed = P.get("fixed", env=env, replicas=5)
    for now, want in ((2, 5), (1, 4), (8, 5), (5, 5)):
        assert decide(fixed, env, delta, hand_state(env, delta, active=[now])) == want
    hpa = P.get("hpa", env=env)
    assert decide(hpa, env, delta, hand_state(env, delta, active=[4], util=[0.2])) == 2


def test_jit_and_vmap_over_states(env8):
    env, params = env8
    rng = np.random.default_rng(0)
    states = []
    for i in range(3):
        k = int(rng.integers(5, 50))
        active = list(rng.integers(1, 9, k))
        serving = [int(rng.integers(1, a + 1)) for a in active]
        states.append(hand_state(env, params, active=active, serving=serving,
                                 util=list(rng.uniform(0, 1, k)),
                                 conc=list(rng.uniform(0, 80, k)),
                                 since_up=float(rng.integers(1, 40)) * DT,
                                 since_down=float(rng.integers(1, 40)) * DT))
    batch = jax.tree.map(lambda *x: jnp.stack(x), *states)
    obs = jnp.zeros((3, AS.NUM_FEATURES), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    for name in AUTOSCALERS:
        pol = P.get(name, env=env)
        out = jax.jit(jax.vmap(pol.fn, in_axes=(0, 0, 0, None)))(keys, obs, batch, params)
        assert out.dtype == jnp.int32 and out.shape == (3,)
        for i, s in enumerate(states):
            assert int(out[i]) + 1 == decide(pol, env, params, s), (name, i)


def test_scheduled_follows_the_cycle_one_warmup_ahead():
    import jax.numpy as jnp

    from jaxserve.envs import autoscaling as AS

    env, params = jaxserve.make("Autoscaling-v0", diurnal_amplitude=0.5,
                                diurnal_period_s=3600.0)
    _, state = env.reset(jax.random.key(0), params)
    pol = P.get("scheduled", env=env, params=params, replicas_at_mean=4.0, lead_s=0.0)
    # The multiplier peaks (1.5) a quarter period in and bottoms out (0.5) at three quarters.
    for clock, want in ((900.0, 6), (2700.0, 2), (0.0, 4)):
        a = pol(jax.random.key(1), None, state.replace(clock=jnp.float32(clock)), params)
        assert int(AS.target_from_action(a, state, params, env.max_replicas)[0]) == want
    # Without a cycle it is a fixed count.
    flat = params.replace(diurnal_amplitude=jnp.float32(0.0))
    a = P.get("scheduled", env=env, params=flat, replicas_at_mean=4.5)(
        jax.random.key(2), None, state, flat)
    assert int(AS.target_from_action(a, state, flat, env.max_replicas)[0]) == 5
    with pytest.raises(ValueError, match="replicas_at_mean"):
        P.get("scheduled", env=env, params=params, replicas_at_mean=0.0)


def test_hold_every_decides_only_every_kth_interval():
    # A policy that asks for a random target every interval changes the active count only at
    # state.time % k == 0 once held, and unheld it changes it more often.
    env, params = jaxserve.make("Autoscaling-v0", max_replicas=4, max_steps_in_episode=40,
                                arrival_rate=0.5)

    def rand(key, obs, state, params):
        return jax.random.randint(key, (), 0, 4)

    def actives(policy):
        obs, state = env.reset(jax.random.key(0), params)

        def step(state, k):
            k_p, k_s = jax.random.split(k)
            a = policy(k_p, env.get_obs(state, params), state, params)
            _, state2, *_ = env.step_env(k_s, state, a, params)
            return state2, ((state2.mode == AS.ACTIVE).sum(), state.time)
        return jax.lax.scan(step, state, jax.random.split(jax.random.key(1), 40))[1]

    active, t = map(np.asarray, actives(PA.hold_every(rand, 4)))
    changed = np.flatnonzero(np.diff(active)) + 1
    assert len(changed) > 0 and (t[changed] % 4 == 0).all()
    free, _ = map(np.asarray, actives(rand))
    assert (t[np.flatnonzero(np.diff(free)) + 1] % 4 != 0).any()
    assert PA.hold_every(rand, 1) is rand
    with pytest.raises(ValueError, match="every"):
        PA.hold_every(rand, 0)


def test_in_action_mode_re_expresses_a_step_policy_by_target():
    env, params = jaxserve.make("Autoscaling-v0", max_replicas=8, initial_replicas=3,
                                max_steps_in_episode=8, arrival_rate=0.5)
    obs, state = env.reset(jax.random.key(0), params)
    for a, want in ((4, 3), (6, 5), (0, 1), (7, 6)):  # delta a - 4 from 3 active, clipped to 1
        step = lambda *_, a=a: jnp.int32(a)  # noqa: E731
        got = PA.in_action_mode(step, AS.DELTA)(None, obs, state, params)
        assert int(got) == want - 1  # target mode: action = target - 1
        tgt, _ = AS.target_from_action(got, state, params, 8)
        assert int(tgt) == want
    with pytest.raises(ValueError, match="mode"):
        PA.in_action_mode(step, 5)
