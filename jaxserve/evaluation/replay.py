"""Replaying a whole trace through an environment with given routing decisions or a policy.

`replay` is how users and tests check schedules: it runs the trace through the environment's
own step function (trace mode, with a per-request log), drains the cluster at the end, and
returns the per-request schedule. The decisions are either given (`actions=`) or made by a
routing policy (`policy=`, the shared `policy(key, obs, state, params)` signature).

`replay_windows` runs many short windows of a trace (`traces.windows`) as episodes, all in
parallel, and returns per-window totals. Both run on the episode driver
(`evaluation.episodes`).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sources import TraceArrays, trace_arrays
from jaxserve.core.types import Trace, validate_trace
from jaxserve.envs import common
from jaxserve.envs.llm_routing import LLMRouting
from jaxserve.envs.base import with_static
from jaxserve.envs.routing import Routing
from jaxserve.evaluation import episodes
from jaxserve.evaluation.evaluate import trace_env


def _replay_fold(num_gpus: int):
    """Per request: whether it was dropped, and the GPU it went to (clipped as the env does)."""
    def fold(acc, s: episodes.Step):
        return acc, (s.info["dropped"], jnp.clip(s.action, 0, num_gpus - 1))
    return fold


@partial(jax.jit, static_argnames=("env",))
def _run_actions(env, key, params: common.ServingParams, actions: jax.Array):
    """Steps `env` (trace mode) once per request with `actions[i]`; the last step drains."""
    obs, state = env.reset_env(key, params)
    keys = jax.random.split(jax.random.fold_in(key, 1), actions.shape[0])
    _, state, _, _, (dropped, _) = episodes.scan_steps(
        env, episodes.from_actions(actions), params, obs, state, keys, keys,
        fold=_replay_fold(env.num_gpus))
    return state.log, dropped


@partial(jax.jit, static_argnames=("env", "policy"))
def _run_policy(env, key, params: common.ServingParams, policy):
    """Steps `env` (trace mode) once per request with the policy's action; the last drains.

    Key layout: reset with `key`; step `i` with `split(fold_in(key, 1), n)[i]`, the policy
    with `fold_in(fold_in(key, 2), i)`.
    """
    obs, state = env.reset_env(key, params)
    n = params.trace.gap.shape[0]
    k_pol = jax.random.fold_in(key, 2)
    pol_keys = jax.vmap(lambda i: jax.random.fold_in(k_pol, i))(jnp.arange(n, dtype=jnp.int32))
    keys = jax.random.split(jax.random.fold_in(key, 1), n)
    _, state, _, _, (dropped, gpu) = episodes.scan_steps(
        env, episodes.from_policy(policy, params), params, obs, state, pol_keys, keys,
        fold=_replay_fold(env.num_gpus))
    return state.log, dropped, gpu


def replay(env, params, trace: Trace, actions=None, *, policy=None,
           key=None) -> dict[str, np.ndarray]:
    """Runs every request of `trace` through `env`'s cluster and drains it.

    Args:
      env: a routing environment such as `make("Routing-v0")[0]` or
        `make("LLMRouting-v0")[0]` (continuous batching; see `token_log` for its result).
      params: its `ServingParams` (GPU profiles, SLO, estimate settings).
      trace: the requests (`jaxserve.Trace`), arrival times in seconds.
      actions: `(n,)` integer GPU index for each request, in `[0, num_gpus)`.
      policy: instead of `actions`, a routing policy `policy(key, obs, state, params) -> GPU`
        that routes every request as it arrives (an out-of-range choice is clipped, as the
        environment does, and reported as the clipped GPU).
      key: PRNG key for noisy output estimates and the policy (default `PRNGKey(0)`).

    Returns:
      dict of numpy arrays, one entry per request: `arrival` (s, float64), `start`, `finish`
      (s, float64; NaN if dropped), `gpu` (int), `dropped` (bool), `batch` (int, global batch
      id in order of (start, gpu); -1 if dropped).

    Raises:
      ValueError: invalid trace, `actions` of the wrong length, type or range, or neither or
        both of `actions` and `policy`.
    """
    tr = validate_trace(trace)
    n = len(tr)
    num_gpus = int(getattr(env, "num_gpus", 0))
    if num_gpus < 1 or not hasattr(env, "replace_static"):
        raise ValueError(f"replay needs a jaxserve routing environment, got {env!r}")
    if policy is not None:
        if actions is not None:
            raise ValueError("give replay either actions= or policy=, not both")
        if not isinstance(env, (Routing, LLMRouting)):
            raise ValueError("replay(policy=...) needs a Routing or LLMRouting environment")
        if not callable(policy):
            raise ValueError(f"policy must be callable, got {type(policy).__name__}")
        env.check_params(params)
        key = jax.random.PRNGKey(0) if key is None else key
        trace_params = params.replace(trace=trace_arrays(tr))
        log, dropped, gpu = _run_policy(trace_env(env, n), key, trace_params, policy)
        return _schedule_of(env, tr, np.asarray(gpu), log, dropped)
    if actions is None:
        raise ValueError("replay needs actions= (one GPU index per request) or policy=")
    acts = np.asarray(actions)
    if acts.ndim != 1 or acts.shape[0] != n:
        raise ValueError(f"actions must have one entry per request: expected shape ({n},), "
                         f"got {acts.shape}")
    if not np.issubdtype(acts.dtype, np.integer):
        if not np.all(np.isfinite(acts)) or np.any(acts != np.round(acts)):
            raise ValueError("actions must be integer GPU indices")
    if np.any(acts < 0) or np.any(acts >= num_gpus):
        bad = int(np.flatnonzero((acts < 0) | (acts >= num_gpus))[0])
        raise ValueError(f"actions[{bad}] = {acts[bad]} is not a GPU index in [0, {num_gpus})")
    env.check_params(params)
    key = jax.random.PRNGKey(0) if key is None else key
    trace_params = params.replace(trace=trace_arrays(tr))
    log, dropped = _run_actions(trace_env(env, n), key, trace_params,
                                jnp.asarray(acts, jnp.int32))
    return _schedule_of(env, tr, acts, log, dropped)


def _schedule_of(env, tr: Trace, gpu: np.ndarray, log, dropped) -> dict:
    """The per-request result of a replay, in the form of the environment's engine."""
    if isinstance(env, LLMRouting):
        return token_log(tr, gpu, log, dropped)
    return per_request_log(tr, gpu, log, dropped)


def token_log(tr: Trace, replica: np.ndarray, log, dropped) -> dict:
    """Per-request outcome of an LLMRouting-v0 replay in absolute float64 seconds.

    `arrival`, `replica`, `first_token`, `finish` (NaN if dropped), `dropped` and
    `preemptions`; the engine logs float32 spans from the arrival, added here to the
    float64 arrival.
    """
    dropped = np.asarray(dropped, bool)
    return {"arrival": tr.arrival_s.copy(), "replica": replica.astype(np.int64),
            "first_token": tr.arrival_s + np.asarray(log.ttft, np.float64),
            "finish": tr.arrival_s + np.asarray(log.e2e, np.float64), "dropped": dropped,
            "preemptions": np.where(dropped, 0, np.asarray(log.preemptions)).astype(np.int64)}


def per_request_log(tr: Trace, gpu: np.ndarray, log, dropped) -> dict:
    """The per-request schedule in absolute float64 seconds.

    The engine logs each request's wait and service as float32 spans; adding them to the
    float64 arrival keeps times exact to the spans' precision however long the trace.
    """
    wait = np.asarray(log.wait, np.float64)
    service = np.asarray(log.service, np.float64)
    start = tr.arrival_s + wait
    finish = start + service
    local = np.asarray(log.batch)
    dropped = np.asarray(dropped, bool)
    batch = np.full(len(tr), -1, np.int64)
    ok = ~dropped
    if ok.any():
        pairs = np.stack([gpu[ok].astype(np.int64), local[ok]], axis=1)
        uniq, inverse = np.unique(pairs, axis=0, return_inverse=True)
        first_start = np.full(len(uniq), np.inf)
        np.minimum.at(first_start, inverse.ravel(), start[ok])
        order = np.lexsort((uniq[:, 0], first_start))
        rank = np.empty(len(uniq), np.int64)
        rank[order] = np.arange(len(uniq))
        batch[ok] = rank[inverse.ravel()]
    return {"arrival": tr.arrival_s.copy(), "start": start, "finish": finish,
            "gpu": gpu.astype(np.int64), "dropped": dropped, "batch": batch}


@partial(jax.jit, static_argnames=("env", "policy", "num_steps"))
def _replay_windows(env, policy, num_steps, key, params, wins, actions):
    def one(key, tr, acts):
        p = params.replace(trace=tr)
        act = episodes.from_actions(acts) if policy is None else episodes.from_policy(policy, p)

        def init(obs, state):
            info = jax.eval_shape(env.step_env, key, state, jnp.int32(0), p)[4]
            zero = {"return": jnp.float32(0.0), "steps": jnp.int32(0)}
            return {**zero, **{k: jnp.zeros(v.shape, v.dtype) for k, v in info.items()}}

        def fold(tot, s: episodes.Step):
            vals = {"return": s.reward, "steps": jnp.int32(1), **s.info}
            tot = jax.tree.map(lambda acc, v: acc + jnp.where(s.live, v, jnp.zeros_like(v)),
                               tot, vals)
            return tot, jnp.where(s.live, s.action, -1)

        _, _, done, tot, taken = episodes.run_episode(env, act, p, key, num_steps, fold=fold,
                                                      init=init, start_done=True)
        tot["terminated"] = done
        tot["actions"] = taken
        # The draining step's `elapsed` runs to the last completion, so the episode's summed
        # `elapsed` is its span from first arrival to last completion.
        tot["makespan"] = tot["elapsed"]
        return tot

    keys = jax.random.split(key, wins.gap.shape[0])
    return jax.vmap(one)(keys, wins, actions)


def replay_windows(env, params, wins: TraceArrays,
                   policy: Callable | np.ndarray | jax.Array, *, key: jax.Array | None = None,
                   num_steps: int | None = None) -> dict[str, jax.Array]:
    """Runs every window as one episode of `env`, all windows in parallel (vmap, one program).

    Each window `w` becomes `params.replace(trace=wins[w])` on
    `env.replace_static(trace_len=L)`; the episode starts with `env.reset` and is stepped with
    `env.step_env` (no auto-reset, no `max_steps_in_episode` truncation: the window's end is
    the episode's end) until it terminates; steps after termination are no-ops.

    Args:
      env: a jaxserve environment (`Routing-v0`, `Batching-v0`).
      params: its `ServingParams` (the `trace` field is replaced per window).
      wins: windows from `windows(...)`, leaves `(W, L)` and `length (W,)`.
      policy: a function `policy(key, obs, state, params) -> action` (traced once, vmapped
        over windows; must be hashable, e.g. a module-level function), or an integer array of
        actions `(W, >= num_steps)`, step `t` of window `w` taking `actions[w, t]`.
      key: PRNG key (default `PRNGKey(0)`); window `w` uses the `w`-th split.
      num_steps: steps scanned per window (default `L`, one routing decision per request;
        Batching-v0 needs more decisions than requests, so pass e.g. `2 * L`).

    Returns:
      dict of `(W,)` arrays: `return` (summed reward), `steps` (decisions taken), every step
      `info` metric summed over the episode (`arrived`, `completed`, `dropped`, `latency_sum`,
      `slo_met`, `busy_time`, `in_system_time`, `elapsed`, `invalid_actions`),
      `terminated` (whether the window's episode ended within `num_steps`), `makespan`
      (seconds from the window's first arrival to its last completion, for a terminated
      episode: the summed `elapsed`, kept under this name; a busy fraction is
      `busy_time / (num_gpus * makespan)`), and `actions`
      `(W, num_steps)` int32: the action of each step, -1 after the episode ended (so a
      window can be replayed request by request, e.g. with `jaxserve.replay`).
    """
    if wins.gap.ndim != 2:
        raise ValueError(f"wins must have a leading window axis (W, L), got {wins.gap.shape}")
    length = int(wins.gap.shape[1])
    env_w = with_static(env, trace_len=length)
    steps = length if num_steps is None else int(num_steps)
    key = jax.random.PRNGKey(0) if key is None else key
    if callable(policy):
        pol, acts = policy, jnp.zeros((wins.gap.shape[0], 1), jnp.int32)
    else:
        acts = jnp.asarray(policy, jnp.int32)
        if acts.ndim != 2 or acts.shape[0] != wins.gap.shape[0]:
            raise ValueError(f"actions must have shape (W, steps) with W={wins.gap.shape[0]}, "
                             f"got {acts.shape}")
        pol = None
        if acts.shape[1] < steps:
            raise ValueError(f"actions must hold at least {steps} steps per window, got "
                             f"{acts.shape[1]}")
    return _replay_windows(env_w, pol, steps, key, params, wins, acts)


