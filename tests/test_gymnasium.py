"""The gymnasium adapters: API contract (check_env), seeding, truncation, vector autoreset."""

import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import jaxserve
import jaxserve.gymnasium as jg

NAMES = ("Routing-v0", "Batching-v0")
STEPS = 20  # max_steps_in_episode: short episodes so loops cross episode boundaries
SMALL = dict(max_steps_in_episode=STEPS)


def rollout(env, actions, seed=None):
    """(obs list, rewards, terminated, truncated, infos) from `reset(seed)` then `actions`."""
    obs, _ = env.reset(seed=seed)
    out = [[obs], [], [], [], []]
    for a in actions:
        o, r, te, tr, info = env.step(a)
        for lst, x in zip(out, (o, r, te, tr, info)):
            lst.append(x)
    return out


def assert_same(x, y, exact=True, path="", rtol=1e-4, atol=1e-4):
    """Structural equality of numpy/Python data; floats within tolerance unless `exact`."""
    if isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), (path, sorted(x), sorted(y))
        for k in x:
            assert_same(x[k], y[k], exact, f"{path}/{k}", rtol, atol)
        return
    if isinstance(x, (list, tuple)):
        assert len(x) == len(y), path
        for i, (a, b) in enumerate(zip(x, y)):
            assert_same(a, b, exact, f"{path}[{i}]", rtol, atol)
        return
    assert type(x) is type(y), (path, type(x), type(y))
    if x is None:
        return
    xa, ya = np.asarray(x), np.asarray(y)
    assert xa.shape == ya.shape and xa.dtype == ya.dtype, (path, xa.shape, ya.shape, xa.dtype,
                                                           ya.dtype)
    if xa.dtype == object:
        for i, (a, b) in enumerate(zip(xa, ya)):
            assert_same(a, b, exact, f"{path}[{i}]", rtol, atol)
    elif xa.dtype.kind == "f" and not exact:
        np.testing.assert_allclose(xa, ya, rtol=rtol, atol=atol, err_msg=path)
    else:
        np.testing.assert_array_equal(xa, ya, err_msg=path)


# ------------------------------------------------------------------------------------------------
# Single environment.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_check_env_passes_without_warnings(name):
    env = jg.make(name, **SMALL)
    assert isinstance(env, gymnasium.Env)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, skip_render_check=True)
    assert [str(w.message) for w in caught] == []
    env.close()
    env.close()  # idempotent


@pytest.mark.parametrize("name", NAMES)
def test_spaces_match_gymnax(name):
    env = jg.make(name, **SMALL)
    genv, params = jaxserve.make(name, **SMALL)
    gob, gac = genv.observation_space(params), genv.action_space(params)
    ob = env.observation_space
    assert isinstance(ob, gymnasium.spaces.Box) and ob.dtype == np.float32
    assert ob.shape == tuple(gob.shape)
    np.testing.assert_array_equal(ob.low, np.broadcast_to(np.float32(gob.low), ob.shape))
    np.testing.assert_array_equal(ob.high, np.broadcast_to(np.float32(gob.high), ob.shape))
    assert isinstance(env.action_space, gymnasium.spaces.Discrete)
    assert env.action_space.n == gac.n == genv.num_actions
    assert env.metadata["render_modes"] == [] and env.render_mode is None
    assert env.render() is None
    with pytest.raises(ValueError, match="render_mode"):
        jg.make(name, render_mode="human")


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_trajectory_different_seed_differs(name):
    env = jg.make(name, **SMALL)
    actions = [np.int64(i % env.action_space.n) for i in range(2 * STEPS + 5)]

    def traj(e, seed):  # a seeded episode, then one continuing the stream (reset())
        first = rollout(e, actions[:STEPS], seed=seed)
        return first, rollout(e, actions[STEPS:], seed=None)

    a = traj(env, 7)
    assert_same(a, traj(env, 7))                        # same instance, re-seeded
    assert_same(a, traj(jg.make(name, **SMALL), 7))     # fresh instance
    b = traj(env, 8)
    assert not np.array_equal(np.stack(a[0][0]), np.stack(b[0][0]))
    # reset() continues the stream: the second episode differs from the first.
    assert not np.array_equal(np.stack(a[0][0][:5]), np.stack(a[1][0][:5]))
    # Types the API promises.
    obs, rew, term, trunc, info = (a[0][k][1] for k in range(5))
    assert isinstance(obs, np.ndarray) and obs.dtype == np.float32 and obs.flags.writeable
    assert type(rew) is float and type(term) is bool and type(trunc) is bool
    assert set(info) >= {"arrived", "completed", "dropped", "invalid_actions", "elapsed"}
    assert all(type(v) in (int, float) for v in info.values())


@pytest.mark.parametrize("name", NAMES)
def test_truncation_after_max_steps_no_autoreset(name):
    env = jg.make(name, **SMALL)
    env.reset(seed=0)
    for t in range(1, STEPS + 1):
        obs, _, term, trunc, _ = env.step(0)
        assert not term
        assert trunc == (t == STEPS), t
    # No auto-reset: stepping on continues the same (truncated) episode.
    _, _, _, trunc, _ = env.step(0)
    assert trunc
    obs0, _ = env.reset(seed=0)
    assert not env.step(0)[3]


def test_step_before_reset_raises():
    env = jg.make("Routing-v0", **SMALL)
    with pytest.raises(gymnasium.error.ResetNeeded):
        env.step(0)


@pytest.mark.parametrize("name", NAMES)
def test_invalid_actions_are_counted_not_raised(name):
    env = jg.make(name, **SMALL)
    n = env.action_space.n
    env.reset(seed=1)
    for a in (np.int64(n + 3), -1, np.array(10 ** 12), np.int32(-7)):
        assert env.step(a)[4]["invalid_actions"] == 1
    for a in (np.int64(0), 0, np.array(0), np.array([0]), np.uint8(0), 0.0, np.float32(1)):
        env.step(a)  # every integer form gymnasium users pass is accepted
    with pytest.raises(ValueError):
        env.step(0.5)
    with pytest.raises(ValueError):
        env.step(np.array([0, 1]))
    with pytest.raises(TypeError):
        env.step("0")


@pytest.mark.parametrize("name", NAMES)
def test_random_loop_stays_finite_and_in_space(name):
    env = jg.make(name, **SMALL)
    env.action_space.seed(0)
    obs, _ = env.reset(seed=3)
    episodes = 0
    for _ in range(3 * STEPS):
        obs, rew, term, trunc, info = env.step(env.action_space.sample())
        assert obs in env.observation_space and np.isfinite(rew)
        assert all(np.isfinite(v) for v in info.values())
        if term or trunc:
            episodes += 1
            obs, _ = env.reset()
    assert episodes == 3


def test_compiled_once_and_shared_across_instances():
    env = jg.make("Routing-v0", **SMALL)
    env.reset(seed=0)
    env.step(0)
    before = dict(jg.TRACE_COUNTS)
    for i in range(30):
        env.step(np.int64(i % 4))
    env.reset(seed=5)
    other = jg.make("Routing-v0", max_steps_in_episode=50, slo_s=3.0)  # same static config
    other.reset()
    other.step(1)
    assert dict(jg.TRACE_COUNTS) == before


def test_registered_with_gymnasium():
    assert "jaxserve/Routing-v0" in gymnasium.registry
    env = gymnasium.make("jaxserve/Routing-v0", **SMALL)
    assert isinstance(env.unwrapped, jg.ServingEnv)
    obs, _ = env.reset(seed=0)
    assert obs in env.observation_space
    env.step(env.action_space.sample())
    env.close()
    venv = gymnasium.make_vec("jaxserve/Routing-v0", num_envs=3, **SMALL)
    assert isinstance(venv, jg.ServingVectorEnv) and venv.num_envs == 3
    assert jg.register_gymnasium_envs() == tuple(f"jaxserve/{n}" for n in
                                                 jaxserve.registered_envs())


def test_gymnax_wrapper_fails_check_env_ours_passes():
    """gymnax's bundled GymnaxToGymWrapper ignores gymnasium's seeding contract (its reset never
    calls `super().reset(seed=seed)`), so gymnasium's checker rejects it; ours passes."""
    from gymnax.wrappers.gym import GymnaxToGymWrapper

    genv, params = jaxserve.make("Routing-v0", **SMALL)
    theirs = GymnaxToGymWrapper(genv, params, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(AssertionError, match="random number generator"):
            check_env(theirs, skip_render_check=True)
    check_env(jg.make("Routing-v0", **SMALL), skip_render_check=True)


# ------------------------------------------------------------------------------------------------
# Vector environment.
# ------------------------------------------------------------------------------------------------

N = 4


def load(obs):
    """Routing-v0's per-GPU load features (all but relative speed): zero on an empty cluster."""
    return obs[:, 3:].reshape(len(obs), -1, 6)[:, :, [0, 1, 2, 3, 5]]


def test_make_vec_spaces_and_shapes():
    venv = jg.make_vec("Routing-v0", N, **SMALL)
    single = jg.make("Routing-v0", **SMALL)
    assert isinstance(venv, gymnasium.vector.VectorEnv) and venv.num_envs == N
    assert venv.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
    assert venv.single_observation_space == single.observation_space
    assert venv.single_action_space == single.action_space
    d = single.observation_space.shape[0]
    assert venv.observation_space.shape == (N, d) and venv.observation_space.dtype == np.float32
    assert isinstance(venv.action_space, gymnasium.spaces.MultiDiscrete)
    np.testing.assert_array_equal(venv.action_space.nvec, [single.action_space.n] * N)
    obs, info = venv.reset(seed=0)
    assert obs.shape == (N, d) and obs.dtype == np.float32 and info == {}
    assert obs in venv.observation_space
    venv.action_space.seed(0)
    obs, rew, term, trunc, info = venv.step(venv.action_space.sample())
    assert obs.shape == (N, d) and rew.shape == term.shape == trunc.shape == (N,)
    assert rew.dtype == np.float64 and term.dtype == trunc.dtype == np.bool_
    assert info["arrived"].shape == (N,) and info["_arrived"].all()
    with pytest.raises(ValueError):
        venv.step(np.zeros(N + 1, int))
    venv.close()
    with pytest.raises(gymnasium.error.ResetNeeded):
        venv.step(np.zeros(N, int))


def _compare_with_sync(name, mode, steps, n=N, seed=11, atol=1e-4):
    """Steps `make_vec` and SyncVectorEnv over single envs side by side: same results.

    Flags, counts and info keys must match exactly; floats up to rounding: XLA's vectorised
    kernels under vmap may round differently in the last bit, and a time-valued quantity then
    carries an absolute error of about one float32 ulp of the largest time in its window."""
    ours = jg.make_vec(name, n, autoreset_mode=mode, **SMALL)
    ref = SyncVectorEnv([lambda: jg.make(name, **SMALL)] * n, autoreset_mode=mode)
    assert_same(ours.reset(seed=seed), ref.reset(seed=seed), exact=False, path="reset",
                atol=atol)
    rng = np.random.default_rng(0)
    done = np.zeros(n, bool)
    for t in range(steps):
        if mode == AutoresetMode.DISABLED and done.any():
            assert_same(ours.reset(options={"reset_mask": done.copy()}),
                        ref.reset(options={"reset_mask": done.copy()}), exact=False,
                        path=f"reset_mask@{t}", atol=atol)
        actions = rng.integers(-1, ours.single_action_space.n + 1, size=n)  # some invalid
        a, b = ours.step(actions), ref.step(actions)
        assert_same(a, b, exact=False, path=f"step{t}", atol=atol)
        done = a[2] | a[3]
    return ours


@pytest.mark.parametrize("mode", list(AutoresetMode))
def test_make_vec_matches_sync_vector_env(mode):
    # 2 full episodes and then some: exercises every autoreset path (and partial resets).
    _compare_with_sync("Routing-v0", mode, 2 * STEPS + 5)


@pytest.mark.slow
def test_make_vec_matches_sync_vector_env_batching():
    # Random actions overload the GPU: windows span tens of seconds (float32 ulp ~4e-6 s) with
    # ~70 requests in system, so in_system_time may differ by ~1e-3 request-seconds.
    for mode in AutoresetMode:
        _compare_with_sync("Batching-v0", mode, 2 * STEPS + 5, atol=3e-3)


def test_make_vec_seeding():
    venv = jg.make_vec("Routing-v0", N, **SMALL)
    acts = [np.arange(N) % 4] * 10

    def traj(seed):
        return rollout(venv, acts, seed=seed)

    a = traj(5)
    assert_same(a, traj(5))
    assert_same(a, traj([5, 6, 7, 8]))                 # int seed s means [s, s + 1, ...]
    assert_same(a, rollout(jg.make_vec("Routing-v0", N, **SMALL), acts, seed=5))
    b = traj(6)
    assert not np.array_equal(a[0][0], b[0][0])
    np.testing.assert_allclose(a[0][0][1:], b[0][0][:-1], rtol=1e-5, atol=1e-6)  # seeds s + i
    # Copy i equals the single env reset with seed 5 + i (up to float rounding under vmap).
    single = rollout(jg.make("Routing-v0", **SMALL), [x[2] for x in acts], seed=7)
    np.testing.assert_allclose(np.stack(single[0]), np.stack([o[2] for o in a[0]]),
                               rtol=1e-5, atol=1e-6)


def test_make_vec_next_step_autoreset():
    venv = jg.make_vec("Routing-v0", N, **SMALL)
    venv.reset(seed=0)
    for t in range(1, STEPS + 1):
        obs, rew, term, trunc, info = venv.step(np.zeros(N, int))
        assert trunc.all() == (t == STEPS) and not term.any()
    obs, rew, term, trunc, info = venv.step(np.zeros(N, int))  # the reset step
    assert (rew == 0).all() and not term.any() and not trunc.any() and info == {}
    assert not load(obs).any()           # the new episodes' first observations: empty GPUs
    obs, rew, term, trunc, info = venv.step(np.zeros(N, int))
    assert not trunc.any() and info["_arrived"].all()


def test_make_vec_same_step_autoreset():
    venv = jg.make_vec("Routing-v0", N, autoreset_mode="SameStep", **SMALL)
    assert venv.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    venv.reset(seed=0)
    for t in range(1, STEPS + 1):
        obs, rew, term, trunc, info = venv.step(np.zeros(N, int))
        assert ("final_obs" in info) == (t == STEPS)
    assert trunc.all() and info["_final_obs"].all() and info["_final_info"].all()
    assert not load(obs).any()                            # already the next episodes' start
    final = np.stack(info["final_obs"])
    assert final.shape == obs.shape and load(final).any(axis=(1, 2)).all()
    assert info["final_info"]["arrived"].tolist() == [1] * N
    assert "arrived" not in info                          # ended copies report via final_info
    obs, rew, term, trunc, info = venv.step(np.zeros(N, int))
    assert not trunc.any() and "final_obs" not in info and info["_arrived"].all()


def test_make_vec_disabled_requires_masked_reset():
    venv = jg.make_vec("Routing-v0", N, autoreset_mode=AutoresetMode.DISABLED, **SMALL)
    venv.reset(seed=0)
    for _ in range(STEPS):
        venv.step(np.zeros(N, int))
    with pytest.raises(gymnasium.error.ResetNeeded):
        venv.step(np.zeros(N, int))
    mask = np.array([True, False, True, False])
    obs, info = venv.reset(options={"reset_mask": mask})
    assert info == {}
    with pytest.raises(gymnasium.error.ResetNeeded):
        venv.step(np.zeros(N, int))     # copies 1 and 3 are still done
    venv.reset(options={"reset_mask": ~mask})
    assert not venv.step(np.zeros(N, int))[3].any()
    with pytest.raises(ValueError, match="reset_mask"):
        venv.reset(options={"reset_mask": np.zeros(N, bool)})


def test_make_vec_random_loop_finite():
    venv = jg.make_vec("Routing-v0", N, **SMALL)
    venv.action_space.seed(1)
    obs, _ = venv.reset(seed=2)
    for _ in range(2 * STEPS + 3):
        obs, rew, term, trunc, info = venv.step(venv.action_space.sample())
        assert obs in venv.observation_space and np.isfinite(rew).all()
