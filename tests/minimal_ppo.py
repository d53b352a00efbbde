"""A minimal PureJaxRL-style PPO, written apart from `agents` on purpose.

It is what a user who imports a jaxserve environment into their own JAX RL code runs:
PureJaxRL's `ppo.py` (Lu et al., 2022) with its published CartPole-v1 hyperparameters, an MLP
actor-critic on the flat observation, the environment stepped through gymnax's
`LegacyStepAPIWrapper` (so `done = terminated or truncated`, and a time limit is treated as
termination, as PureJaxRL does), and no reward or observation normalisation. Nothing in it
knows about serving; `tests/test_learnable.py` trains it on the registered defaults.

    train = make_train(CONFIG, env, env_params)
    params, returns = jax.jit(train)(jax.random.PRNGKey(0))
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen.initializers import constant, orthogonal
from flax.training.train_state import TrainState
from gymnax.wrappers import LegacyStepAPIWrapper

# PureJaxRL's CartPole-v1 configuration (purejaxrl/ppo.py), unchanged but for the budget.
CONFIG = dict(LR=2.5e-4, NUM_ENVS=16, NUM_STEPS=128, TOTAL_TIMESTEPS=500_000, UPDATE_EPOCHS=4,
              NUM_MINIBATCHES=4, GAMMA=0.99, GAE_LAMBDA=0.95, CLIP_EPS=0.2, ENT_COEF=0.01,
              VF_COEF=0.5, MAX_GRAD_NORM=0.5, ACTIVATION="tanh", ANNEAL_LR=True)


class ActorCritic(nn.Module):
    """PureJaxRL's actor-critic: two tanh layers of 64 for each head, orthogonal init."""

    action_dim: int
    hidden: Sequence[int] = (64, 64)

    @nn.compact
    def __call__(self, x):
        a = x
        for h in self.hidden:
            a = jnp.tanh(nn.Dense(h, kernel_init=orthogonal(np.sqrt(2)),
                                  bias_init=constant(0.0))(a))
        logits = nn.Dense(self.action_dim, kernel_init=orthogonal(0.01),
                          bias_init=constant(0.0))(a)
        c = x
        for h in self.hidden:
            c = jnp.tanh(nn.Dense(h, kernel_init=orthogonal(np.sqrt(2)),
                                  bias_init=constant(0.0))(c))
        value = nn.Dense(1, kernel_init=orthogonal(1.0), bias_init=constant(0.0))(c)
        return logits, jnp.squeeze(value, -1)


class Transition(NamedTuple):
    done: jax.Array
    action: jax.Array
    value: jax.Array
    reward: jax.Array
    log_prob: jax.Array
    obs: jax.Array


def make_train(config: dict, env, env_params, diagnostics=None):
    """PureJaxRL's `make_train`: returns `(train, network)`, `train(rng) -> (network params,
    (mean step reward, fraction of steps ending an episode) per update)`. The environment is
    wrapped in `LegacyStepAPIWrapper`.

    `diagnostics`, if given, is `f(traj, adv, targets, logits, values) -> dict of arrays`,
    evaluated after each update's rollout on that rollout (`Transition` fields `(NUM_STEPS,
    NUM_ENVS, ...)`, the GAE advantages and value targets, and the updated network's logits
    and values on `traj.obs`); its dicts are then a third per-update output. It only reads:
    training is the same with or without it."""
    cfg = dict(CONFIG, **config)
    num_updates = cfg["TOTAL_TIMESTEPS"] // cfg["NUM_STEPS"] // cfg["NUM_ENVS"]
    minibatch = cfg["NUM_ENVS"] * cfg["NUM_STEPS"] // cfg["NUM_MINIBATCHES"]
    env = LegacyStepAPIWrapper(env)
    network = ActorCritic(env.action_space(env_params).n)

    def linear_schedule(count):
        frac = 1.0 - (count // (cfg["NUM_MINIBATCHES"] * cfg["UPDATE_EPOCHS"])) / num_updates
        return cfg["LR"] * frac

    def train(rng):
        rng, k_net, k_env = jax.random.split(rng, 3)
        obs_shape = env.observation_space(env_params).shape
        net_params = network.init(k_net, jnp.zeros(obs_shape, jnp.float32))
        lr = linear_schedule if cfg["ANNEAL_LR"] else cfg["LR"]
        tx = optax.chain(optax.clip_by_global_norm(cfg["MAX_GRAD_NORM"]),
                         optax.adam(learning_rate=lr, eps=1e-5))
        ts = TrainState.create(apply_fn=network.apply, params=net_params, tx=tx)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(k_env, cfg["NUM_ENVS"]), env_params)

        def update(runner, _):
            def env_step(runner, _):
                ts, env_state, obs, rng = runner
                rng, k_act, k_step = jax.random.split(rng, 3)
                logits, value = network.apply(ts.params, obs)
                action = jax.random.categorical(k_act, logits)
                log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None],
                                               -1)[:, 0]
                obs2, env_state, reward, done, _ = jax.vmap(
                    env.step, in_axes=(0, 0, 0, None))(
                    jax.random.split(k_step, cfg["NUM_ENVS"]), env_state, action, env_params)
                return (ts, env_state, obs2, rng), Transition(done, action, value, reward,
                                                               log_prob, obs)

            runner, traj = jax.lax.scan(env_step, runner, None, cfg["NUM_STEPS"])
            ts, env_state, last_obs, rng = runner
            _, last_val = network.apply(ts.params, last_obs)

            def gae_step(carry, t):
                gae, next_value = carry
                delta = t.reward + cfg["GAMMA"] * next_value * (1 - t.done) - t.value
                gae = delta + cfg["GAMMA"] * cfg["GAE_LAMBDA"] * (1 - t.done) * gae
                return (gae, t.value), gae

            _, adv = jax.lax.scan(gae_step, (jnp.zeros_like(last_val), last_val), traj,
                                  reverse=True, unroll=16)
            targets = adv + traj.value

            def epoch(carry, _):
                ts, rng = carry
                rng, k_perm = jax.random.split(rng)
                batch = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]),
                                     (traj, adv, targets))
                perm = jax.random.permutation(k_perm, minibatch * cfg["NUM_MINIBATCHES"])
                batch = jax.tree.map(lambda x: x[perm].reshape(
                    (cfg["NUM_MINIBATCHES"], minibatch) + x.shape[1:]), batch)

                def mb_step(ts, mb):
                    t, a, tgt = mb

                    def loss_fn(p):
                        logits, value = network.apply(p, t.obs)
                        logp_all = jax.nn.log_softmax(logits)
                        logp = jnp.take_along_axis(logp_all, t.action[:, None], -1)[:, 0]
                        v_clip = t.value + jnp.clip(value - t.value, -cfg["CLIP_EPS"],
                                                    cfg["CLIP_EPS"])
                        v_loss = 0.5 * jnp.maximum((value - tgt) ** 2,
                                                   (v_clip - tgt) ** 2).mean()
                        ratio = jnp.exp(logp - t.log_prob)
                        an = (a - a.mean()) / (a.std() + 1e-8)
                        pg = -jnp.minimum(ratio * an, jnp.clip(
                            ratio, 1 - cfg["CLIP_EPS"], 1 + cfg["CLIP_EPS"]) * an).mean()
                        ent = -(jnp.exp(logp_all) * logp_all).sum(-1).mean()
                        return pg + cfg["VF_COEF"] * v_loss - cfg["ENT_COEF"] * ent

                    grads = jax.grad(loss_fn)(ts.params)
                    return ts.apply_gradients(grads=grads), None

                ts, _ = jax.lax.scan(mb_step, ts, batch)
                return (ts, rng), None

            (ts, rng), _ = jax.lax.scan(epoch, (ts, rng), None, cfg["UPDATE_EPOCHS"])
            out = (traj.reward.mean(), traj.done.mean())
            if diagnostics is not None:
                out = out + (diagnostics(traj, adv, targets, *network.apply(ts.params, traj.obs)),)
            return (ts, env_state, last_obs, rng), out

        runner = (ts, env_state, obs, rng)
        (ts, *_), rewards = jax.lax.scan(update, runner, None, num_updates)
        return ts.params, rewards

    return train, network


def greedy_policy(network, params):
    """The trained actor as a jaxserve policy `(key, obs, state, params) -> action`."""
    def policy(key, obs, state, env_params):
        logits, _ = network.apply(params, obs)
        return jnp.argmax(logits, -1).astype(jnp.int32)
    return policy


def main(argv=None):
    """`python -m tests.minimal_ppo [--steps N] [--episode N] [--set k=v ...]`: trains on
    `jaxserve.make("Routing-v0", **sets)` and prints PPO against JSQ, round robin and SITA on
    fresh-arrival streams (the measurement recorded in docs/training.md)."""
    import argparse
    import ast
    import time

    import jaxserve
    from jaxserve import policies

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=CONFIG["TOTAL_TIMESTEPS"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], help="env overrides k=v")
    ap.add_argument("--eval-envs", type=int, default=16)
    ap.add_argument("--eval-steps", type=int, default=1000)
    a = ap.parse_args(argv)
    overrides = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in a.set)}
    env, params = jaxserve.make("Routing-v0", **overrides)
    train, network = make_train({"TOTAL_TIMESTEPS": a.steps}, env, params)
    t0 = time.perf_counter()
    net_params, (rewards, _) = jax.block_until_ready(jax.jit(train)(jax.random.PRNGKey(a.seed)))
    print(f"trained {a.steps} steps in {time.perf_counter() - t0:.0f} s; mean step reward "
          f"first/last update {float(rewards[0]):.3f} / {float(rewards[-1]):.3f}")
    pols = {"ppo": greedy_policy(network, net_params)}
    for name in ("jsq", "round_robin", "least_work_left", "sed"):
        pols[name] = policies.get(name)
    pols["sita"] = policies.get("sita", params=params)
    res = jaxserve.evaluate_many(env, params, pols, jax.random.PRNGKey(12345), a.eval_envs,
                                 a.eval_steps)
    for name, r in res.items():
        print(f"{name:16s} mean latency {r['mean_latency']:8.2f} s  p99 {r['p99_latency']:8.1f}"
              f"  dropped {r['dropped']:6d}")


if __name__ == "__main__":
    main()
