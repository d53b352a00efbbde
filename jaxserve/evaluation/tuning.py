"""Choosing a policy's settings by simulation, on tuning streams disjoint from evaluation.

`tune_static` grid-searches the static batcher (B, tau) in one vmapped program and registers
the `tuned_static` batching policy. It lives with the evaluation harness because it *is* an
evaluation (the same rollouts and summaries), run on `tuning_key` streams that
`evaluate_many` then refuses.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sources import mark_tuning_key, tuning_key
from jaxserve.evaluation.evaluate import (_check_args, is_routing, make_streams, rollout_envs,
                                          summarise, trace_env)
from jaxserve.policies.batching import default_grid, make_static
from jaxserve.policies.registry import Policy, register


def make_batcher(max_batch, timeout, table):
    """A batcher that acts by `table[q]` where that is >= 0, else as `static(B, tau)`.

    All three may be traced: one vmapped program then evaluates static settings and
    queue-length tables (such as the SMDP optimum) side by side.
    """
    static = make_static(max_batch, timeout)

    def batcher(key, obs, state, params):
        q = state.cluster.queues.count[0]
        t = table[jnp.minimum(q, table.shape[0] - 1)]
        return jnp.where(t >= 0, t, static(key, obs, state, params)).astype(jnp.int32)

    return batcher


@partial(jax.jit, static_argnames=("env_t",))
def _run_grid(env_t, params, streams, keys, bs, taus, tables):
    def one(b, tau, table):
        return rollout_envs(env_t, make_batcher(b, tau, table), params, streams, keys, False)
    return jax.vmap(one)(bs, taus, tables)


def tune_static(env, params, key=None, max_batches=None, timeouts=None, num_envs: int = 8,
                num_steps: int = 1000, warmup: int = 0, compare_tables=None):
    """Grid search over static (B, tau), every grid point on the same request streams.

    One compiled program: the rollout is vmapped over the grid (and over environments), not
    looped in Python. The objective is the environment's own cost per request,
    `(time-in-system + drop_penalty_s * drops) / requests` in seconds: the mean latency when
    nothing is dropped (Little's law, the run drains), so also what `smdp_optimal` minimises.

    Args:
      env, params: a Batching-v0 environment and its parameters.
      key: the PRNG key of the tuning streams (default `tuning_key()`, i.e. `tuning_key(
        PRNGKey(0))`). It is recorded as a tuning key, and `evaluate` refuses it, so the
        setting is never scored on the streams it was chosen on: pass
        `tuning_key(eval_key)` when the evaluation will use `eval_key`.
      max_batches, timeouts: the grid axes (default `default_grid(params)`).
      num_envs, num_steps, warmup: as in `jaxserve.evaluate`.
      compare_tables: optional `{name: table}` of queue-length tables (q -> action, e.g.
        `smdp_optimal`'s `info["table"]`) evaluated in the same program on the same streams,
        for comparison; they are reported in the table (`policy` = name) but never chosen.

    Returns:
      (best `Policy`, table): the table is a list of dicts, one per grid point (and compared
      table), with `policy` ("static" or the table's name), `max_batch`, `timeout`,
      `cost_per_request`, `cost_ci95`, `mean_latency`, `mean_latency_ci95`, `p99_latency`,
      `drop_rate`, `throughput`, `arrived`, `completed`, `dropped_total`, `in_flight` and
      `per_env_cost` (numpy, per environment); sorted by cost (best first).
    """
    if is_routing(env):
        raise ValueError("tune_static needs a Batching-v0 environment")
    _check_args(env, params, num_envs, num_steps, warmup)
    d_b, d_t = default_grid(params)
    bs = np.asarray(d_b if max_batches is None else max_batches, np.int32)
    taus = np.asarray(d_t if timeouts is None else timeouts, np.float32)
    if bs.ndim != 1 or taus.ndim != 1 or bs.size == 0 or taus.size == 0:
        raise ValueError("max_batches and timeouts must be non-empty 1-D sequences")
    if np.any(bs < 1) or np.any(np.isnan(taus)) or np.any(taus < 0):
        # tau = inf is allowed: static(B, inf) waits for B requests (never times out).
        raise ValueError("grid needs max_batch >= 1 and timeouts >= 0 (inf allowed)")
    key = tuning_key() if key is None else mark_tuning_key(key)
    gb, gt = (a.ravel() for a in np.meshgrid(bs, taus, indexing="ij"))
    qmax = int(np.asarray(params.gpus.queue_cap)[0]) + 1  # queue lengths 0..queue_cap
    names = ["static"] * gb.shape[0]
    tables = [np.full(qmax, -1, np.int32)] * gb.shape[0]
    for name, t in (compare_tables or {}).items():
        t = np.asarray(t, np.int32)
        if t.ndim != 1 or t.size == 0 or np.any(t < 0):
            raise ValueError(f"compare_tables[{name!r}] must be a 1-D table of actions >= 0")
        names.append(str(name))
        tables.append(np.concatenate([t, np.full(qmax, t[-1], np.int32)])[:qmax])
        gb, gt = np.append(gb, bs.max()), np.append(gt, np.float32(0))
    tables = np.stack(tables)
    streams, keys = make_streams(key, params, int(num_envs), int(num_steps), None)
    env_t = trace_env(env, streams.gap.shape[1])
    out = jax.device_get(_run_grid(env_t, params, streams, keys, jnp.asarray(gb),
                                   jnp.asarray(gt), jnp.asarray(tables)))
    rows = []
    for i in range(gb.shape[0]):
        s = summarise(jax.tree.map(lambda x, i=i: x[i], out), streams, params, warmup)
        static = names[i] == "static"
        rows.append({"policy": names[i], "max_batch": int(gb[i]) if static else None,
                     "timeout": float(gt[i]) if static else None,
                     **{k: s[k] for k in ("cost_per_request", "cost_ci95", "mean_latency",
                                          "mean_latency_ci95", "p99_latency", "drop_rate",
                                          "throughput", "arrived", "completed",
                                          "dropped_total", "in_flight")},
                     "per_env_cost": s["per_env"]["cost_per_request"]})
    rows.sort(key=lambda r: r["cost_per_request"])
    table = rows
    best = next(r for r in rows if r["policy"] == "static")
    pol = Policy(name="tuned_static", kind="batching",
                 fn=make_static(best["max_batch"], best["timeout"]),
                 info={"max_batch": best["max_batch"], "timeout": best["timeout"],
                       "table": table})
    return pol, table


@register("tuned_static", "batching")
def _tuned_factory(env=None, params=None, key=None, max_batches=None, timeouts=None,
                   num_envs: int = 8, num_steps: int = 1000, warmup: int = 0):
    """The best static (B, tau) of a grid (see `tune_static`); the grid is `info["table"]`."""
    if env is None or params is None:
        raise ValueError("policy 'tuned_static' needs env= and params= (it simulates the grid)")
    pol, _ = tune_static(env, params, key, max_batches, timeouts, num_envs, num_steps, warmup)
    return pol
