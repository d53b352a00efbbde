"""Replaying a whole trace through an environment with given routing decisions or a policy.

`replay` is how users and tests check schedules: it runs the trace through the environment's
own step function (trace mode, with a per-request log), drains the cluster at the end, and
returns the per-request schedule. The decisions are either given (`actions=`) or made by a
routing policy (`policy=`, the shared `policy(key, obs, state, params)` signature).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.types import Trace, validate_trace
from jaxserve.envs import common
from jaxserve.envs.llm_routing import LLMRouting
from jaxserve.envs.routing import Routing
from jaxserve.evaluation.evaluate import trace_env


@partial(jax.jit, static_argnames=("env",))
def _run_actions(env, key, params: common.ServingParams, actions: jax.Array):
    """Steps `env` (trace mode) once per request with `actions[i]`; the last step drains."""
    _, state = env.reset_env(key, params)

    def step(state, x):
        k, a = x
        _, state, _, _, info = env.step_env(k, state, a, params)
        return state, info["dropped"]

    n = actions.shape[0]
    keys = jax.random.split(jax.random.fold_in(key, 1), n)
    state, dropped = jax.lax.scan(step, state, (keys, actions))
    return state.log, dropped


@partial(jax.jit, static_argnames=("env", "policy"))
def _run_policy(env, key, params: common.ServingParams, policy):
    """Steps `env` (trace mode) once per request with the policy's action; the last drains."""
    obs, state = env.reset_env(key, params)
    k_pol = jax.random.fold_in(key, 2)

    def step(carry, x):
        obs, state = carry
        i, k = x
        a = jnp.asarray(policy(jax.random.fold_in(k_pol, i), obs, state, params)).astype(
            jnp.int32).reshape(())
        obs, state, _, _, info = env.step_env(k, state, a, params)
        return (obs, state), (info["dropped"], jnp.clip(a, 0, env.num_gpus - 1))

    n = params.trace.gap.shape[0]
    keys = jax.random.split(jax.random.fold_in(key, 1), n)
    (_, state), (dropped, gpu) = jax.lax.scan(
        step, (obs, state), (jnp.arange(n, dtype=jnp.int32), keys))
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
        trace_params = params.replace(trace=common.trace_arrays(tr))
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
    trace_params = params.replace(trace=common.trace_arrays(tr))
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
