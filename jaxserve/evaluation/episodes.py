"""The episode driver: how a policy (or a fixed action sequence) is run through an environment.

Every evaluation path steps an environment the same way: a policy picks an action from
`(key, obs, state, params)`, `env.step_env` advances the state, and something is folded
over the steps (summed metrics, the action taken). `scan_steps` is that loop, written once;
callers differ only in

* the keys: each caller keeps its own documented key layout (so its numbers stay
  reproducible), and passes the per-step policy and environment keys in;
* the actor: `from_policy` (the shared `policy(key, obs, state, params)` signature) or
  `from_actions` (step `i` takes `actions[i]`, for replaying a given schedule);
* the length: `scan_steps` runs a fixed number of steps, `loop_steps` runs until the
  episode terminates (at most a cap) when the number of decisions depends on the actions;
* masking: with `masked=True`, steps after termination are no-ops (state and observation
  frozen, `live` False), for episodes that end before the scan does;
* the fold: `fold(acc, Step) -> (acc, y)` reduces the steps (a running sum in the carry, or
  per-step rows stacked by the scan).

`run_episode` adds the reset and the split key layout (`(k_reset, k_run) = split(key)`;
step `t` uses `split(split(k_run, num_steps)[t])` as `(k_policy, k_env)`), which the
autoscaler evaluation and the trace-window replays share. The CRN harness's rollout and the
per-request replay keep their own layouts (`evaluation.evaluate.rollout`, `replay`) and call
`scan_steps` directly.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.core.tree import select


class Step(NamedTuple):
    """One step, as a fold sees it.

    Attributes:
      index: int32 step index `i`.
      action: int32 `()`, the action taken (before the environment clips it).
      obs, state: after the step (with `masked=True`, frozen once the episode has ended).
      reward: float32 `()`; terminated: bool `()`; info: the step's info dict.
      live: bool `()`, False for a masked step after termination (always True unmasked).
    """

    index: jax.Array
    action: jax.Array
    obs: Any
    state: Any
    reward: jax.Array
    terminated: jax.Array
    info: dict
    live: jax.Array


def as_action(a) -> jax.Array:
    """A policy's output as an int32 scalar action."""
    return jnp.asarray(a).astype(jnp.int32).reshape(())


def from_policy(policy: Callable, params) -> Callable:
    """The actor `act(i, key, obs, state)` of `policy(key, obs, state, params)`."""
    return lambda i, key, obs, state: as_action(policy(key, obs, state, params))


def from_actions(actions: jax.Array) -> Callable:
    """The actor that takes `actions[i]` at step `i` (the last action past the end)."""
    return lambda i, key, obs, state: actions[jnp.minimum(i, actions.shape[0] - 1)]


def scan_steps(env, act: Callable, params, obs, state, policy_keys, env_keys, *,
               fold: Callable, acc=None, done=None, masked: bool = False):
    """Steps `env` once per entry of `env_keys` from `(obs, state)`; not jitted.

    Args:
      env: an environment with gymnax's `step_env`.
      act: `act(i, key, obs, state) -> action` (`from_policy`, `from_actions`).
      params: the environment parameters passed to every step.
      obs, state: where the episode starts (usually `env.reset`).
      policy_keys, env_keys: `(T,)` keys: step `i` acts with `policy_keys[i]` and steps the
        environment with `env_keys[i]`.
      fold: `fold(acc, Step) -> (acc, y)`; `y` is stacked over the steps.
      acc: the fold's initial carry.
      done: bool `()`, whether the episode has already ended (masked only; default False).
      masked: freeze the state and observation after termination and mark later steps
        `live=False`; otherwise every step is live and the environment's own state is kept
        (an unmasked scan is used when the step count is the episode's length).

    Returns:
      `(obs, state, done, acc, ys)` after the last step (`done` is False unmasked).
    """
    done = jnp.bool_(False) if done is None else done

    def body(carry, x):
        obs, state, done, acc = carry
        i, k_pol, k_env = x
        a = act(i, k_pol, obs, state)
        obs2, state2, reward, term, info = env.step_env(k_env, state, a, params)
        if masked:
            live = ~done
            obs2, state2 = select(live, obs2, obs), select(live, state2, state)
            done2 = done | term
        else:
            live, done2 = jnp.bool_(True), done
        acc, y = fold(acc, Step(i, jnp.asarray(a, jnp.int32), obs2, state2, reward, term,
                                info, live))
        return (obs2, state2, done2, acc), y

    n = env_keys.shape[0]
    xs = (jnp.arange(n, dtype=jnp.int32), policy_keys, env_keys)
    (obs, state, done, acc), ys = jax.lax.scan(body, (obs, state, done, acc), xs)
    return obs, state, done, acc, ys


def loop_steps(env, act: Callable, params, obs, state, keys_of: Callable, max_steps, *,
               fold: Callable, acc):
    """Steps `env` until it terminates or `max_steps` steps have run (a `while_loop`).

    For episodes whose number of decisions depends on the actions (Batching-v0): under
    `vmap` the loop runs until the last lane has ended, not for a fixed worst case.

    Args:
      env, act, params, obs, state: as `scan_steps`.
      keys_of: `keys_of(i) -> (policy_key, env_key)` for step `i` (int32).
      max_steps: int32 cap on the steps.
      fold: `fold(acc, Step) -> acc` (no per-step output: the step count is not static).
      acc: the fold's initial carry.

    Returns:
      `(obs, state, done, acc, steps)`: `steps` int32, the steps taken.
    """
    def cond(c):
        return (~c[2]) & (c[4] < max_steps)

    def body(c):
        obs, state, _, acc, i = c
        k_pol, k_env = keys_of(i)
        a = act(i, k_pol, obs, state)
        obs, state, reward, done, info = env.step_env(k_env, state, a, params)
        acc = fold(acc, Step(i, jnp.asarray(a, jnp.int32), obs, state, reward, done, info,
                             jnp.bool_(True)))
        return obs, state, done, acc, i + 1

    return jax.lax.while_loop(cond, body, (obs, state, jnp.bool_(False), acc, jnp.int32(0)))


def run_episode(env, act: Callable, params, key, num_steps: int, *, fold: Callable,
                init: Callable = lambda obs, state: None, start_done: bool = False):
    """`env.reset` then `num_steps` masked steps in the split key layout (module docstring).

    Args:
      env, params: the environment and its parameters.
      act: the actor (`from_policy(policy, params)` or `from_actions(actions)`).
      key: the episode's key.
      num_steps: steps scanned; steps after termination are masked.
      fold: as in `scan_steps`.
      init: `init(obs, state) -> acc`, the fold's initial carry (it may need the reset state,
        e.g. to shape zeros like the step's info).
      start_done: count an episode that is already terminated at reset
        (`env.is_terminated`) as ended, so every step is masked.

    Returns:
      `(obs, state, done, acc, ys)` as `scan_steps`.
    """
    k_reset, k_run = jax.random.split(key)
    obs, state = env.reset(k_reset, params)
    keys = jax.random.split(k_run, num_steps)
    pairs = jax.vmap(jax.random.split)(keys)
    done = env.is_terminated(state, params) if start_done else jnp.bool_(False)
    return scan_steps(env, act, params, obs, state, pairs[:, 0], pairs[:, 1], fold=fold,
                      acc=init(obs, state), done=done, masked=True)
