"""Imitation warm start: the actor-critic fitted to a heuristic's decisions before RL.

A learned router that starts from scratch must rediscover what a good heuristic already
knows (SITA's size partition) before it can improve on it, and at the budgets a CPU affords
it may never get there (docs/results.md, (w): PPO's budget curves on the bursty scenarios).
Starting PPO from a behaviour-cloned copy of the heuristic asks the RL part only for the
improvement. `imitate` rolls the heuristic in the training environments (never on
evaluation streams: the heuristic's own fit, e.g. SITA's thresholds, comes from tuning
streams), fits the actor to its actions (cross-entropy) and the critic to the discounted
returns it earned (the same discounting as the agent's), and returns the runner state PPO
continues from. One pure function of the runner state: it runs inside the training program.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxserve.agents.returns import gae
from jaxserve.agents.rollout import RunnerState, categorical_log_prob, step_discount
from jaxserve import policies
from jaxserve.core.sources import tuning_key

# Demonstration steps per training environment, full-batch Adam steps and their learning rate
# (with these a clone of sita_predicted on bursty scored 9.89 s against SITA's 9.58 s:
# docs/confirmations.md, section C).
DEFAULTS = {"num_steps": 512, "epochs": 300, "lr": 3e-3}


def heuristic(env: Any, env_params: Any, name: str, seed: int):
    """The registered policy `name` for `env`, fitted (where it fits anything) on a tuning
    key derived from `seed`, which evaluation refuses. ValueError for a name that is not a
    realisable policy of the environment's kind (oracles read true lengths: not imitated)."""
    kind = getattr(env, "policy_kind", None)
    names = [n for n in policies.names(kind) if "oracle" not in n] if kind else []
    if name not in names:
        raise ValueError(f"cannot imitate {name!r}: "
                         + (f"{type(env).__name__} has no policy kind" if not kind else
                            f"known {kind} policies: {names}"))
    kw = ({"key": tuning_key(jax.random.PRNGKey(seed))}
          if "key" in policies.options(name, kind=kind) else {})
    return policies.get(name, kind=kind, env=env, params=env_params, **kw)


def demonstrations(runner: RunnerState, env: Any, env_params: Any, policy: Callable,
                   num_steps: int, gamma: float, discount_time_s: float | None):
    """Steps every environment of `runner` `num_steps` times with `policy(key, obs, state,
    params)` (a lax.scan).

    Returns:
      `(runner, obs (T, E, D), action (T, E) int32, returns (T, E) float32)`: the runner after
      the rollout (environments where the heuristic left them, train_state unchanged) and each
      step's discounted return to the end of the rollout (cut at episode ends; the last steps'
      returns are truncated, see `imitate`).
    """
    num_envs = runner.obs.shape[0]
    vstep = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    vpol = jax.vmap(policy, in_axes=(0, 0, 0, None))

    def step(carry, _):
        env_state, obs, key = carry
        key, k_act, k_env = jax.random.split(key, 3)
        action = vpol(jax.random.split(k_act, num_envs), obs, env_state,
                      env_params).astype(jnp.int32)
        obs2, env_state, reward, term, trunc, info = vstep(jax.random.split(k_env, num_envs),
                                                           env_state, action, env_params)
        disc = jnp.broadcast_to(step_discount(gamma, discount_time_s, info), reward.shape)
        return (env_state, obs2, key), (obs, action, reward.astype(jnp.float32), disc, term,
                                        jnp.logical_or(term, trunc))

    (env_state, obs, key), (o, a, r, disc, term, done) = jax.lax.scan(
        step, (runner.env_state, runner.obs, runner.key), None, num_steps)
    # Monte Carlo returns cut at episode ends: GAE with lambda 1 and zero values.
    zeros = jnp.zeros_like(r)
    _, returns = gae(r, zeros, zeros, term, done, disc, 1.0)
    return runner._replace(env_state=env_state, obs=obs, key=key), o, a, returns


def imitate(runner: RunnerState, env: Any, env_params: Any, policy: Callable, *,
            num_steps: int, epochs: int, lr: float, vf_coef: float, gamma: float,
            discount_time_s: float | None, value_fraction: float = 0.75) -> RunnerState:
    """Fits the runner's network to `policy` on `num_steps` x num_envs of its decisions.

    `epochs` full-batch Adam steps (learning rate `lr`) on cross-entropy of the actor's
    logits against the heuristic's actions plus `vf_coef` times the squared error of the
    critic against the discounted returns. Only the first `value_fraction` of the rollout's
    steps enter the value loss: the returns of the last steps are cut short by the rollout's
    end (with a ~100 s horizon at Routing-v0's rates, about the last 200 decisions).

    Returns the runner state after the demonstrations, with the fitted parameters and the
    agent's optimizer state as it was (PPO starts its own Adam moments from there).
    """
    runner, obs, act, ret = demonstrations(runner, env, env_params, policy, num_steps, gamma,
                                           discount_time_s)
    obs = obs.reshape((-1,) + obs.shape[2:])
    act, ret = act.reshape(-1), ret.reshape(-1)
    keep = int(round(num_steps * value_fraction)) * runner.obs.shape[0]
    weight = (jnp.arange(act.shape[0]) < keep).astype(jnp.float32)
    ts = runner.train_state
    tx = optax.adam(lr)

    def loss_fn(params):
        logits, value = ts.apply_fn(params, obs)
        ce = -categorical_log_prob(logits, act).mean()
        vl = (weight * (value - ret) ** 2).sum() / weight.sum()
        return ce + vf_coef * vl

    def fit(carry, _):
        params, opt = carry
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    (params, _), _ = jax.lax.scan(fit, (ts.params, tx.init(ts.params)), None, epochs)
    return runner._replace(train_state=ts.replace(params=params))


def warm_start(runner: RunnerState, env: Any, env_params: Any, policy: Callable, config: Any,
               **options: Any) -> RunnerState:
    """`imitate` with the agent's own value weight and discounting (`config.vf_coef`,
    `gamma`, `discount_time_s`) and `DEFAULTS` for the options not given (`num_steps`,
    `epochs`, `lr`)."""
    opts = {**DEFAULTS, **options}
    return imitate(runner, env, env_params, policy, num_steps=int(opts["num_steps"]),
                   epochs=int(opts["epochs"]), lr=float(opts["lr"]), vf_coef=config.vf_coef,
                   gamma=config.gamma, discount_time_s=config.discount_time_s)
