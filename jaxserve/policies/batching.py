"""Batchers for Batching-v0: the static (B, tau) rule and greedy (the tuned grid search that
picks a static setting by simulation is `jaxserve.evaluation.tuning.tune_static`).

Batching-v0 asks for a decision only when the GPU is idle and requests wait, at an arrival or
a completion instant. A static batcher's timeout can therefore only fire at such an instant:
`static(B, tau)` dispatches `min(q, B)` when `q >= B` or the head of the queue has waited at
least `tau` *at the decision instant*, and otherwise waits for the next arrival. (The engine's
own static batcher, in Routing-v0, dispatches at `a_head + tau` exactly; here a timeout that
expires between two arrivals fires at the next arrival. `tau = 0` is identical in both.)
The policies read the queue length and the head's arrival time only, never
`BatchingState.upcoming` (the future).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.core import cluster as C
from jaxserve.core import queues as Q
from jaxserve.core.service import single_request_time
from jaxserve.policies.registry import Policy, register
from jaxserve.policies.routing import workload_means


def make_static(max_batch=None, timeout=None):
    """The static batcher `policy(key, obs, state, params)`.

    Args:
      max_batch (int | jax.Array | None): B (default: the GPU profile's `max_batch`); clipped
        to the GPU's batch limit. May be a traced value (grid search vmaps over it).
      timeout (float | jax.Array | None): tau in seconds (default: the GPU profile's `timeout`). May be traced.
    """

    def static(key, obs, state, params):
        cl = state.cluster
        count = cl.queues.count[0]
        limit = C.batch_limit(cl, params.gpus)[0]
        b = limit if max_batch is None else jnp.clip(jnp.asarray(max_batch, jnp.int32), 1, limit)
        tau = params.gpus.timeout[0] if timeout is None else jnp.asarray(timeout, jnp.float32)
        head_wait = -Q.arrival_at(cl.queues, jnp.zeros((1,), jnp.int32))[0]
        go = (count >= b) | (head_wait >= tau)
        return jnp.where(go, jnp.minimum(count, b), 0).astype(jnp.int32)

    return static


def default_grid(params):
    """Default (B, tau) grid: B in powers of two up to `max_batch` (and `max_batch`);
    tau in {0, 0.25, 0.5, 1, 2, 4} x the mean single-request service time, and inf.

    tau = inf ("dispatch exactly B once B wait", never time out) belongs to the static family
    and is the best static rule where the SMDP optimum is a control limit at B."""
    b_max = int(np.asarray(params.gpus.max_batch)[0])
    bs = sorted({1 << i for i in range(b_max.bit_length()) if (1 << i) <= b_max} | {b_max})
    p, o = workload_means(params)
    t1 = float(np.asarray(single_request_time(params.gpus, p, o))[0])
    taus = [round(f * t1, 6) for f in (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)] + [float("inf")]
    return bs, taus


@register("static", "batching", scenario_free=True)
def _static_factory(env=None, params=None, max_batch=None, timeout=None):
    """Static (B, tau) batcher; defaults are the GPU profile's own."""
    return Policy(name="static", kind="batching", fn=make_static(max_batch, timeout),
                  info={"max_batch": max_batch, "timeout": timeout})


@register("greedy", "batching", scenario_free=True)
def _greedy_factory(env=None, params=None, max_batch=None):
    """Dispatch whatever waits (up to B) whenever the GPU is idle: static(B, 0)."""
    return Policy(name="greedy", kind="batching", fn=make_static(max_batch, 0.0),
                  info={"max_batch": max_batch, "timeout": 0.0})
