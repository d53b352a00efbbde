"""jaxserve.evaluation.episodes: the one episode driver (masked scan, key layout, actors)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve
from jaxserve import policies as P
from jaxserve.core.sources import trace_arrays
from jaxserve.envs.base import with_static
from jaxserve.evaluation import episodes as E

N = 5  # requests in the replayed trace: Routing-v0 terminates after the 5th decision


def _scenario():
    env, params = jaxserve.make("Routing-v0")
    tr = jaxserve.Trace(arrival_s=np.cumsum(np.full(N, 0.5)), prompt_tokens=np.full(N, 64),
                        output_tokens=np.array([32, 256, 64, 512, 128]))
    return with_static(env, trace_len=N, log_capacity=N), params.replace(trace=trace_arrays(tr))


def test_select_is_leafwise():
    new = {"a": jnp.arange(3), "b": jnp.float32(1.0)}
    old = {"a": -jnp.arange(3), "b": jnp.float32(2.0)}
    assert jax.tree.all(jax.tree.map(jnp.array_equal, E.select(True, new, old), new))
    assert jax.tree.all(jax.tree.map(jnp.array_equal, E.select(False, new, old), old))
    # A per-env flag (E,) broadcasts over each leaf's trailing axes (gymnasium's batched reset).
    flag = jnp.array([True, False])
    got = E.select(flag, {"x": jnp.ones((2, 3)), "y": jnp.ones(2)},
                   {"x": jnp.zeros((2, 3)), "y": jnp.zeros(2)})
    np.testing.assert_array_equal(got["x"], [[1, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(got["y"], [1, 0])


def test_from_actions_holds_the_last_action():
    act = E.from_actions(jnp.array([2, 0, 1], jnp.int32))
    assert [int(act(jnp.int32(i), None, None, None)) for i in range(5)] == [2, 0, 1, 1, 1]


def test_run_episode_masks_steps_after_termination():
    env, params = _scenario()
    jsq = P.get("jsq", env=env, params=params)
    key = jax.random.PRNGKey(7)

    def fold(acc, s):
        return acc + jnp.where(s.live, s.reward, 0.0), (s.live, s.action)

    run = jax.jit(lambda k: E.run_episode(env, E.from_policy(jsq, params), params, k, N + 3,
                                          fold=fold, init=lambda o, s: jnp.float32(0.0)))
    _, state, done, ret, (live, actions) = run(key)
    assert bool(done) and np.asarray(live).tolist() == [True] * N + [False] * 3

    # The same episode by hand in the documented key layout, exactly N unmasked steps: the
    # masked tail changes nothing.
    k_reset, k_run = jax.random.split(key)
    obs, st = env.reset(k_reset, params)
    total = 0.0
    for t, k in enumerate(jax.random.split(k_run, N + 3)[:N]):
        k_pol, k_env = jax.random.split(k)
        a = jsq(k_pol, obs, st, params)
        assert int(a) == int(actions[t])
        obs, st, r, term, _ = env.step_env(k_env, st, a, params)
        total += float(r)
    assert bool(term)
    np.testing.assert_allclose(float(ret), total, rtol=1e-6)
    # Every request was logged, and the masked steps left the terminal state as it was.
    np.testing.assert_allclose(np.asarray(state.log.wait), np.asarray(st.log.wait), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state.log.service), np.asarray(st.log.service),
                               rtol=1e-6)
    assert np.isfinite(np.asarray(state.log.service)).all()
