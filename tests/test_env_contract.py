"""One contract for every registered environment (Jumanji-style shared contract test).

Parametrised over `jaxserve.registered_envs()`, so an environment registered later is held to
it without editing this file. Each environment is built with its registered defaults and a
short episode (`max_steps_in_episode=5`); every check reads one of two compiled programs per
environment (a 16-step rollout, and the same vmapped over lanes of (params, key), so one program
checks vmap over environments and over parameters; compiling is most of this file's time). The
rollout steps through gymnax's `LegacyStepAPIWrapper`, which calls `env.step` and adds `done`,
so that the wrapper's check needs no program of its own:

- gymnax 1.0 step: six outputs, float32 observation and reward, bool flags,
  `info["final_observation"]`, observations inside `observation_space`;
- time limits are truncation, never termination, and the step auto-resets;
- gymnax's `LegacyStepAPIWrapper` gives five outputs with `done = terminated or truncated`;
- jit traces once (new keys and new parameter values do not retrace), same key same result;
- vmap over environments and parameters equals a loop over single runs (counts exactly, floats
  to float32 rounding under vmap): lanes with other keys and with other parameter values, and
  for the environments in `VARIED` a lane whose parameters change the dynamics (the lanes their
  own test files vmapped over before: an environment-specific hook, not a second program);
- everything finite; out-of-range actions are clipped and counted in `info["invalid_actions"]`.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnax.wrappers.compat import LegacyStepAPIWrapper

import jaxserve

ENVS = tuple(jaxserve.registered_envs())
EPISODE = 5
STEPS = 16


@functools.lru_cache(maxsize=None)
def build(name):
    return jaxserve.make(name, max_steps_in_episode=EPISODE)


def rollout(env, params, key, bad=False):
    """`STEPS` steps with random actions, or (`bad`, traced) alternately -1 and
    `num_actions + 3`, through `LegacyStepAPIWrapper(env).step` (`env.step`'s six outputs
    less its two flags, plus `done`; `env.step` also puts the flags in `info`); stacked
    `(obs, reward, terminated, truncated, info, done)`."""
    legacy = LegacyStepAPIWrapper(env)
    obs, state = env.reset(key, params)

    def step(state, x):
        t, k = x
        k_a, k_s = jax.random.split(k)
        out_of_range = jnp.where(t % 2 == 0, -1, env.num_actions + 3)
        a = jnp.where(bad, out_of_range, env.action_space(params).sample(k_a))
        out = legacy.step(k_s, state, a, params)
        assert len(out) == 5
        obs, state, r, done, info = out
        return state, (obs, r, info["terminated"], info["truncated"], info, done)

    return jax.lax.scan(step, state, (jnp.arange(STEPS), jax.random.split(key, STEPS)))


TRACES: dict[str, int] = {}


@functools.lru_cache(maxsize=None)
def programs(name):
    """(single rollout, vmapped over (params, key) lanes) for env `name`; the single one counts
    its traces in `TRACES[name]` (the body runs only when jit traces it)."""
    env, _ = build(name)

    def traced_once(p, k, bad):
        TRACES[name] = TRACES.get(name, 0) + 1
        return rollout(env, p, k, bad)

    jitted = jax.jit(traced_once)

    def single(p, k, bad=False):
        # `bad` always passed as a traced bool: jit keys its cache on the call's signature, so
        # a default left out would compile a second program.
        return jitted(p, k, jnp.bool_(bad))

    lanes = jax.jit(jax.vmap(lambda p, k: rollout(env, p, k)))
    return single, lanes


def double_latency_scale(params):
    """`params` with `latency_scale` (wherever it sits) doubled: every reward halves."""
    def double(path, x):
        return x * 2.0 if jax.tree_util.keystr(path).endswith("latency_scale") else x

    return jax.tree_util.tree_map_with_path(double, params)


# Per environment, parameter values that change the dynamics, not only the reward's scale: a
# fourth lane of the vmap check (same compiled programs; the values keep each leaf's dtype so
# that jit does not trace again).
VARIED = {
    # the replayed trace's inter-arrival gaps halved: other admissions, prefix hits, evictions
    "LLMPrefixRouting-v0": lambda p: p.replace(trace=p.trace.replace(gap=p.trace.gap * 0.5)),
    # another GPU price and a 30 s warm-up: other costs and other replicas serving
    "LLMAutoscaling-v0": lambda p: p.replace(gpu_price=jnp.full_like(p.gpu_price, 4.0),
                                             warmup_s=jnp.full_like(p.warmup_s, 30.0)),
    # four times the arrival rate on half the KV blocks: other queues, preemptions, drops
    "LLMRouting-v0": lambda p: p.replace(arrivals=p.arrivals.replace(rates=p.arrivals.rates * 4.0),
                                         gpus=p.gpus.replace(kv_blocks=p.gpus.kv_blocks // 2)),
}


def assert_close_trees(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating):
            # XLA:CPU may round exp/log differently in the last bit under vmap; every count
            # and flag (the event sequence) must still be identical.
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
        else:
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", ENVS)
def test_step_contract_truncation_and_auto_reset(name):
    env, params = build(name)
    single, *_ = programs(name)
    state, (obs, rew, term, trunc, info, _) = single(params, jax.random.PRNGKey(0))
    # env.step's own six outputs (traced, not compiled again: the rollout traced it)
    _, state0 = jax.eval_shape(env.reset, jax.random.PRNGKey(0), params)
    six = jax.eval_shape(env.step, jax.random.PRNGKey(0), state0, jnp.int32(0), params)
    assert len(six) == 6 and six[5]["terminated"] == six[3] and six[5]["truncated"] == six[4]
    assert obs.shape == (STEPS,) + env.observation_space(params).shape
    assert obs.dtype == jnp.float32 and rew.dtype == jnp.float32
    assert term.dtype == jnp.bool_ and trunc.dtype == jnp.bool_
    assert info["final_observation"].shape == obs.shape
    space = env.observation_space(params)
    assert all(bool(space.contains(o)) for o in obs)
    assert all(bool(space.contains(o)) for o in info["final_observation"])
    # Synthetic arrivals never terminate: every EPISODE-th decision truncates, then resets;
    # an environment that draws each episode's horizon at reset (`state.horizon`, so vmapped
    # episodes are not in lockstep) truncates after ceil(EPISODE / 2) to EPISODE decisions.
    assert not bool(term.any())
    ends = np.flatnonzero(np.asarray(trunc))
    lengths = np.diff(np.concatenate([[-1], ends]))
    if hasattr(state, "horizon"):
        assert ends.size and np.all((lengths >= (EPISODE + 1) // 2) & (lengths <= EPISODE))
    else:
        np.testing.assert_array_equal(np.asarray(trunc), (np.arange(STEPS) + 1) % EPISODE == 0)
    assert int(state.time) == STEPS - 1 - ends[-1]
    for leaf in jax.tree.leaves((obs, rew, info)):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64))), name


@pytest.mark.parametrize("name", ENVS)
def test_legacy_wrapper_returns_five_values(name):
    """Five outputs (the rollout asserts it as it traces), `done = terminated or truncated`
    at every step, the flags kept in `info`; the same compiled program as the first test."""
    env, params = build(name)
    single, *_ = programs(name)
    _, (_, _, term, trunc, info, done) = single(params, jax.random.PRNGKey(0))
    assert "truncated" in info and "terminated" in info and done.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(done), np.asarray(term | trunc))
    assert bool(done.any()) and not bool(done.all())
    assert TRACES[name] == 1


@pytest.mark.parametrize("name", ENVS)
def test_one_trace_and_vmap_over_envs_and_params_equals_loop(name):
    _, params = build(name)
    single, lanes = programs(name)
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    other = double_latency_scale(params)
    lane_args = [(params, k1), (params, k2), (other, k1)]
    if name in VARIED:
        lane_args.append((VARIED[name](params), k1))
    batched = lanes(*jax.tree.map(lambda *xs: jnp.stack(xs), *lane_args))
    # New keys and new parameter values reuse the compiled program (one trace, below).
    runs = [single(p, k) for p, k in lane_args]
    chex.assert_trees_all_equal(runs[0], single(params, k1))  # same key, same result
    # Another key, another rollout (the sampled actions, and for sampled arrivals the
    # rewards; a replayed trace's first steps may earn the same rewards under any action).
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])))
    # Doubling latency_scale halves every reward.
    np.testing.assert_allclose(np.asarray(runs[2][1][1]), np.asarray(runs[0][1][1]) / 2.0,
                               rtol=1e-5, atol=1e-7)
    if name in VARIED:  # the varied parameters move the rollout itself, not only rewards
        assert any(not np.array_equal(a, b) for a, b in
                   zip(jax.tree.leaves(runs[0][0]), jax.tree.leaves(runs[3][0])))
    for i, run in enumerate(runs):
        assert_close_trees(jax.tree.map(lambda x: x[i], batched), run)
    # dtypes survive vmap and scan (no leaf is promoted by a batched parameter)
    assert [x.dtype for x in jax.tree.leaves(batched)] == [
        x.dtype for x in jax.tree.leaves(runs[0])]
    assert TRACES[name] == 1


@pytest.mark.parametrize("name", ENVS)
def test_out_of_range_actions_are_clipped_and_counted(name):
    _, params = build(name)
    single, *_ = programs(name)
    _, (obs, rew, term, trunc, info, _) = single(params, jax.random.PRNGKey(3), True)
    np.testing.assert_array_equal(np.asarray(info["invalid_actions"]) >= 1, True)
    for leaf in jax.tree.leaves((obs, rew, info)):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64))), name
    assert TRACES[name] == 1  # the same program as the random-action rollouts
