"""Replaying a whole trace through an environment with given routing decisions.

`replay` is how users and tests check schedules: it runs the trace through the environment's
own step function (trace mode, with a per-request log), drains the cluster at the end, and
returns the per-request schedule.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.types import Trace, validate_trace
from jaxserve.envs import common


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


def replay(env, params, trace: Trace, actions=None, *, key=None) -> dict[str, np.ndarray]:
    """Runs every request of `trace` through `env`'s cluster and drains it.

    Args:
      env: a routing environment such as `make("Routing-v0")[0]`.
      params: its `ServingParams` (GPU profiles, SLO, estimate settings).
      trace: the requests (`jaxserve.Trace`), arrival times in seconds.
      actions: `(n,)` integer GPU index for each request, in `[0, num_gpus)`.
      key: PRNG key for noisy output estimates (default `PRNGKey(0)`).

    Returns:
      dict of numpy arrays, one entry per request: `arrival` (s, float64), `start`, `finish`
      (s, float64; NaN if dropped), `gpu` (int), `dropped` (bool), `batch` (int, global batch
      id in order of (start, gpu); -1 if dropped).

    Raises:
      ValueError: invalid trace, or `actions` of the wrong length, type or range.
    """
    tr = validate_trace(trace)
    n = len(tr)
    num_gpus = int(getattr(env, "num_gpus", 0))
    if num_gpus < 1 or not hasattr(env, "replace_static"):
        raise ValueError(f"replay needs a jaxserve routing environment, got {env!r}")
    if actions is None:
        raise ValueError("replay needs actions= (one GPU index per request)")
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
    common.validate_params(params, env.queue_buffer)
    key = jax.random.PRNGKey(0) if key is None else key
    trace_env = env.replace_static(trace_len=n, log_capacity=n)
    trace_params = params.replace(trace=common.trace_arrays(tr))
    log, dropped = _run_actions(trace_env, key, trace_params, jnp.asarray(acts, jnp.int32))
    return per_request_log(tr, acts, log, dropped)


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
