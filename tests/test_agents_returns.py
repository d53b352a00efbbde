"""GAE / Monte Carlo returns with truncation bootstrapping, and the rollout that feeds them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.agents import collect_rollout, gae
from tests import test_agents_common as common

GAMMA, LAM = 0.9, 0.8


def _reference_gae(r, v, nv, term, done, gamma, lam):
    """Plain-Python GAE over one env (lists), the definition written out step by step."""
    adv, next_adv = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        delta = r[t] + gamma * (0.0 if term[t] else nv[t]) - v[t]
        next_adv = delta + gamma * lam * (0.0 if done[t] else next_adv)
        adv[t] = next_adv
    return np.array(adv)


def test_truncated_step_bootstraps_from_final_observation():
    # Step 1 is truncated: its next value is V(final_obs) = 10, while V(obs after reset) = 0.5.
    r = jnp.array([1.0, 1.0, 1.0])
    v = jnp.array([2.0, 3.0, 0.5])
    nv = jnp.array([3.0, 10.0, 4.0])  # V(final_obs_t); nv[0] = v[1], nv[2] bootstraps the end
    term = jnp.array([False, False, False])
    done = jnp.array([False, True, False])
    adv, targets = gae(r, v, nv, term, done, GAMMA, LAM)
    d2 = 1.0 + GAMMA * 4.0 - 0.5
    d1 = 1.0 + GAMMA * 10.0 - 3.0  # bootstrapped, and not mixed with step 2 (recursion cut)
    d0 = 1.0 + GAMMA * 3.0 - 2.0
    np.testing.assert_allclose(adv, [d0 + GAMMA * LAM * d1, d1, d2], rtol=1e-6)
    np.testing.assert_allclose(targets, np.asarray(adv) + np.asarray(v), rtol=1e-6)
    # Treating the truncation as a termination would drop the gamma * V(final_obs) term.
    adv_term, _ = gae(r, v, nv, done, done, GAMMA, LAM)
    assert float(adv[1] - adv_term[1]) == pytest.approx(GAMMA * 10.0)


def test_terminated_step_does_not_bootstrap():
    adv, targets = gae(jnp.array([1.0]), jnp.array([5.0]), jnp.array([7.0]),
                       jnp.array([True]), jnp.array([True]), GAMMA, LAM)
    np.testing.assert_allclose(adv, [1.0 - 5.0])
    np.testing.assert_allclose(targets, [1.0])


@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_gae_matches_reference(lam):
    rng = np.random.default_rng(0)
    t_len, n_env = 20, 3
    r, v, nv = (rng.normal(size=(t_len, n_env)).astype(np.float32) for _ in range(3))
    term = rng.random((t_len, n_env)) < 0.1
    done = term | (rng.random((t_len, n_env)) < 0.1)
    nv[:-1] = np.where(done[:-1], nv[:-1], v[1:])  # as in a rollout: V(next obs) inside episodes
    adv, targets = gae(r, v, nv, term, done, GAMMA, lam)
    for e in range(n_env):
        ref = _reference_gae(r[:, e], v[:, e], nv[:, e], term[:, e], done[:, e], GAMMA, lam)
        np.testing.assert_allclose(adv[:, e], ref, rtol=1e-5, atol=1e-5)
    if lam == 1.0:  # Monte Carlo returns, bootstrapped at truncations and at the rollout end
        for e in range(n_env):
            g = 0.0
            for t in reversed(range(t_len)):
                cont = nv[t, e] if (done[t, e] or t == t_len - 1) else g
                g = r[t, e] + GAMMA * (0.0 if term[t, e] else cont)
                assert targets[t, e] == pytest.approx(g, rel=1e-4, abs=1e-4)


def test_rollout_records_value_of_final_observation():
    """With a 5-step time limit, truncations happen and use V(pre-reset obs), not V(reset obs)."""
    env, params = common.cartpole()
    params = params.replace(max_steps_in_episode=5)
    trainer = common.ppo_trainer()  # reuse its compiled init; env params are a traced argument
    runner = trainer.init(jax.random.key(1))
    rollout = jax.jit(collect_rollout, static_argnums=(1, 3))
    runner, traj = rollout(runner, env, params, 12)
    num_envs = trainer.config.num_envs
    assert traj.obs.shape == (12, num_envs, 4) and traj.value.shape == (12, num_envs)
    truncated = np.asarray(traj.done & ~traj.terminated)
    assert truncated.any()
    assert set(np.asarray(traj.episode_length)[truncated]) == {5}
    # Inside episodes the next value is V(next obs) (same params, same obs).
    cont = ~np.asarray(traj.done)[:-1]
    np.testing.assert_allclose(np.asarray(traj.next_value)[:-1][cont],
                               np.asarray(traj.value)[1:][cont], rtol=1e-5, atol=1e-6)
    # At episode ends it is not the value of the reset observation.
    ends = np.asarray(traj.done)[:-1]
    assert not np.allclose(np.asarray(traj.next_value)[:-1][ends], np.asarray(traj.value)[1:][ends])
    # The last step bootstraps from the observation the rollout stopped in.
    _, last_value = trainer.network.apply(runner.train_state.params, runner.obs)
    last_cont = ~np.asarray(traj.done)[-1]
    np.testing.assert_allclose(np.asarray(traj.next_value)[-1][last_cont],
                               np.asarray(last_value)[last_cont], rtol=1e-5, atol=1e-6)


def test_rollout_end_values_under_vmap_over_seeds():
    """V(final_observation) is computed only at steps where some episode ended (one
    conditional for the batch, `lanes.batch_max` under vmap): vmapped over two seeds whose
    episodes end at different steps (time limits 5 and 7), each seed's next values equal
    its own rollout's."""
    env, params = common.cartpole()
    trainer = common.ppo_trainer()
    runners = [trainer.init(jax.random.key(s)) for s in (1, 2)]
    limits = [params.replace(max_steps_in_episode=m) for m in (5, 7)]
    rollout = lambda r, p: collect_rollout(r, env, p, 12)  # noqa: E731
    singles = [jax.jit(rollout)(r, p)[1] for r, p in zip(runners, limits)]
    stack = lambda xs: jax.tree.map(lambda *x: jnp.stack(x), *xs)  # noqa: E731
    both = jax.jit(jax.vmap(rollout))(stack(runners), stack(limits))[1]
    for i, single in enumerate(singles):
        np.testing.assert_array_equal(np.asarray(both.done[i]), np.asarray(single.done))
        np.testing.assert_allclose(np.asarray(both.next_value[i]),
                                   np.asarray(single.next_value), rtol=1e-5, atol=1e-6)
    # Steps where neither seed's episodes end exist, and steps where only one's do.
    ends = np.asarray(both.done).any(-1)
    assert (~ends.any(0)).any() and (ends[0] != ends[1]).any()


def _reference_gae_per_step(r, v, nv, term, done, gammas, lam):
    """As `_reference_gae`, with a discount per step (semi-Markov envs)."""
    adv, next_adv = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        delta = r[t] + gammas[t] * (0.0 if term[t] else nv[t]) - v[t]
        next_adv = delta + gammas[t] * lam * (0.0 if done[t] else next_adv)
        adv[t] = next_adv
    return np.array(adv)


def test_gae_with_per_step_discounts_matches_reference():
    rng = np.random.default_rng(3)
    t = 12
    r, v, nv = (rng.normal(size=t) for _ in range(3))
    term = rng.random(t) < 0.1
    done = term | (rng.random(t) < 0.1)
    gammas = rng.uniform(0.5, 1.0, size=t)
    adv, targets = gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(nv), jnp.asarray(term),
                       jnp.asarray(done), jnp.asarray(gammas, jnp.float32), LAM)
    want = _reference_gae_per_step(r, v, nv, term, done, gammas, LAM)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(targets, want + v, rtol=1e-5, atol=1e-5)
    # A constant per-step discount is the scalar case.
    a1, _ = gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(nv), jnp.asarray(term),
                jnp.asarray(done), jnp.full((t,), GAMMA, jnp.float32), LAM)
    a2, _ = gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(nv), jnp.asarray(term),
                jnp.asarray(done), GAMMA, LAM)
    np.testing.assert_allclose(a1, a2, rtol=1e-6)


def test_step_discount_by_elapsed_time():
    from jaxserve.agents.rollout import step_discount

    elapsed = jnp.asarray([0.0, 5.0, 10.0, 2.5], jnp.float32)
    got = step_discount(0.9, 5.0, {"elapsed": elapsed})
    np.testing.assert_allclose(got, [1.0, 0.9, 0.81, 0.9 ** 0.5], rtol=1e-6)
    assert float(step_discount(0.9, None, {})) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="elapsed"):
        step_discount(0.9, 5.0, {})
    from jaxserve.agents.config import PPOConfig
    with pytest.raises(ValueError, match="discount_time_s"):
        PPOConfig(discount_time_s=0.0)
