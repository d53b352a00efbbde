"""Replaying a whole trace through the engine with given routing decisions.

`replay` is how users and tests check schedules: it returns the per-request log of a trace run
to completion (the system drained), computed by the same engine functions the environments use.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core import cluster as C
from jaxserve.core.types import Trace, validate_trace
from jaxserve.envs import common


@partial(jax.jit, static_argnames=("num_gpus", "capacity"))
def _replay_actions(key, params: common.ServingParams, trace: common.TraceArrays,
                    actions: jax.Array, num_gpus: int, capacity: int):
    """Scans the trace: advance to each arrival, route it to `actions[i]`, then drain."""
    n = trace.gap.shape[0]
    keys = jax.random.split(key, n)

    def step(carry, x):
        cl, log = carry
        gap, prompt, output, gpu, i, k = x
        cl, _, log = C.advance_static(cl, params.gpus, gap, params.slo_s, log)
        cl = C.rebase(cl, gap)
        req = common.draw_request(k, params, 0.0, i, (prompt, output))
        cl, dropped = C.route(cl, params.gpus, req, gpu)
        return (cl, log), dropped

    carry = (C.empty_cluster(num_gpus, capacity), C.empty_log(n))
    xs = (trace.gap, trace.prompt, trace.output, actions, jnp.arange(n, dtype=jnp.int32), keys)
    (cl, log), dropped = jax.lax.scan(step, carry, xs)
    cl, _, log = C.advance_static(cl, params.gpus, jnp.float32(jnp.inf), params.slo_s, log)
    return log, dropped


def replay(env, params, trace: Trace, actions=None, *, key=None) -> dict[str, np.ndarray]:
    """Runs every request of `trace` through `env`'s cluster and drains it.

    Args:
      env: a routing environment (its `num_gpus` and `queue_buffer` are used).
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
    if num_gpus < 1:
        raise ValueError(f"replay needs a routing environment with num_gpus >= 1, got {env!r}")
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
    arrays = common.trace_arrays(tr)
    log, dropped = _replay_actions(key, params, arrays, jnp.asarray(acts, jnp.int32),
                                   num_gpus, env.queue_buffer)
    return _per_request_log(tr, acts, log, dropped)


def _per_request_log(tr: Trace, gpu: np.ndarray, log: C.RequestLog, dropped) -> dict:
    """Absolute float64 times from the float32 offsets the engine logs (exact to f32 spans)."""
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
