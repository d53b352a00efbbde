"""Choosing a policy's settings by simulation, on tuning streams disjoint from evaluation.

`tune_static` grid-searches the static batcher (B, tau) in one vmapped program and registers
the `tuned_static` batching policy; `tune_sita` chooses SITA's orientation and spill
threshold (routing) the same way and registers `sita_tuned`. They live with the evaluation
harness because each *is* an evaluation (the same rollouts and summaries), run on
`tuning_key` streams that `evaluate_many` then refuses.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sources import mark_tuning_key, tuning_key
from jaxserve.evaluation.evaluate import (_check_args, is_routing, make_streams, rollout_envs,
                                          summarise, trace_env)
from jaxserve.core.service import single_request_time
from jaxserve.policies.batching import default_grid, make_static
from jaxserve.policies.registry import Policy, register
from jaxserve.policies.routing import (SitaFit, fit_sita, make_sita_burst, make_sita_overflow,
                                      workload_means)


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
      env (Environment): a Batching-v0 environment.
      params (ServingParams): its parameters.
      key (jax.Array): the PRNG key of the tuning streams (default `tuning_key()`, i.e. `tuning_key(
        PRNGKey(0))`). It is recorded as a tuning key, and `evaluate` refuses it, so the
        setting is never scored on the streams it was chosen on: pass
        `tuning_key(eval_key)` when the evaluation will use `eval_key`.
      max_batches (sequence of int): the grid's batch sizes (default `default_grid(params)`).
      timeouts (sequence of float): the grid's timeouts in seconds (default likewise).
      num_envs (int): as in `jaxserve.evaluate`.
      num_steps (int): as in `jaxserve.evaluate`.
      warmup (int): as in `jaxserve.evaluate`.
      compare_tables (dict | None): optional `{name: table}` of queue-length tables (q -> action, e.g.
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


# Spill thresholds of `tune_sita`, in multiples of the mean request's service time
# alone on a mean-speed GPU; inf (never spill) makes plain SITA one of the candidates.
OVERFLOW_GRID = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, float("inf"))


def _stack_fits(fits):
    """Thresholds `(F, K-1)`, masks `(F, K, G)` and predictor coefficients `(F, 3)` of SITA fits
    padded to a common K: a padded threshold is +inf (its interval is never chosen), a padded
    mask row is all False."""
    k = max(f.mask.shape[0] for f in fits)
    th = np.full((len(fits), k - 1), np.inf, np.float32)
    mask = np.zeros((len(fits), k, fits[0].mask.shape[1]), bool)
    coef = np.zeros((len(fits), 3), np.float32)
    for i, f in enumerate(fits):
        th[i, :f.thresholds.shape[0]] = f.thresholds
        mask[i, :f.mask.shape[0]] = f.mask
        coef[i] = f.predictor
    return th, mask, coef


def tune_sita(env, params, key=None, fits=None, grid=None,
                       num_envs: int = 8, num_steps: int = 1024, warmup: int = 64):
    """SITA with overflow (`policies.routing.make_sita_overflow`): its size intervals' GPU
    orientation and spill threshold chosen by simulation on tuning streams.

    Candidates: each SITA fit (default: `fit_sita(params, tuning key, predictor="predicted",
    order=o)` for o in slow_first and fast_first, i.e. short requests on the slow or on the
    fast GPUs; both split on the output length predicted from prompt and estimate, as
    `sita_predicted`) with each spill threshold of the grid. `fit_sita` alone chooses the
    orientation by load balance, blind to queueing delay; here the measured latency decides.
    Every candidate runs on the same streams in one vmapped program; the chosen one minimises
    the drop-inclusive mean latency (s, drops at `drop_penalty_s`), ties to the first fit and
    the larger threshold (closer to plain SITA).

    Args:
      env (Environment): a Routing-v0 environment.
      params (ServingParams): its parameters.
      key (jax.Array | None): PRNG key of the tuning streams (default `tuning_key()`);
        recorded as a tuning key, which evaluation refuses: pass `tuning_key(eval_key)`.
      fits (dict | None): `{name: SitaFit}` with size predictors (default: the two
        orientations above).
      grid (sequence of float | None): spill thresholds in seconds (default: `OVERFLOW_GRID`
        times the mean request's `single_request_time`, averaged over GPUs).
      num_envs (int): as in `jaxserve.evaluate`.
      num_steps (int): as in `jaxserve.evaluate`.
      warmup (int): as in `jaxserve.evaluate`.

    Returns:
      (`Policy` "sita_tuned", table): the table has one dict per candidate, `fit`,
        `overflow_s`, `mean_latency_incl_drops`, `mean_latency`, `dropped`, sorted best first.
    """
    if not is_routing(env):
        raise ValueError("tune_sita needs a Routing-v0 environment")
    _check_args(env, params, num_envs, num_steps, warmup)
    key = tuning_key() if key is None else mark_tuning_key(key)
    if fits is None:
        fits = {o: fit_sita(params, key=key, predictor="predicted", order=o)
                for o in ("slow_first", "fast_first")}
    if not fits or any(f.predictor is None for f in fits.values()):
        raise ValueError("tune_sita: fits must be a non-empty {name: SitaFit} of fits "
                         "with a size predictor (fit_sita(..., predictor=...))")
    if grid is None:
        p, o = workload_means(params)
        unit = float(np.mean(np.asarray(single_request_time(params.gpus, p, o))))
        grid = [g * unit for g in OVERFLOW_GRID]
    thetas = np.asarray([float(g) for g in grid], np.float32)
    if thetas.ndim != 1 or thetas.size == 0 or np.any(np.isnan(thetas)) or np.any(thetas < 0):
        raise ValueError("tune_sita: grid must be a non-empty list of thresholds >= 0 "
                         "(seconds; inf allowed)")
    names = list(fits)
    th, mask, coef = _stack_fits([fits[n] for n in names])
    cand_fit, cand_theta = (a.ravel() for a in np.meshgrid(np.arange(len(names)), thetas,
                                                           indexing="ij"))
    streams, keys = make_streams(key, params, int(num_envs), int(num_steps), None)
    env_t = trace_env(env, streams.gap.shape[1])

    @jax.jit
    def run(params, streams, keys, th, mask, coef, theta):
        def one(th, mask, coef, theta):
            fit = SitaFit(thresholds=th, mask=mask, utilisation=None, max_rho_per_rate=None,
                          predictor=coef)
            return rollout_envs(env_t, make_sita_overflow(fit, theta), params, streams, keys,
                                True)
        return jax.vmap(one)(th, mask, coef, theta)

    out = jax.device_get(run(params, streams, keys, th[cand_fit], mask[cand_fit],
                             coef[cand_fit], cand_theta))
    rows = []
    for i in range(cand_fit.shape[0]):
        s = summarise(jax.tree.map(lambda x, i=i: x[i], out), streams, params, warmup)
        rows.append({"fit": names[cand_fit[i]], "overflow_s": float(cand_theta[i]),
                     "mean_latency_incl_drops": s["mean_latency_incl_drops"],
                     "mean_latency": s["mean_latency"], "dropped": s["dropped"]})
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["mean_latency_incl_drops"],
                                                    cand_fit[i], -cand_theta[i]))
    rows = [rows[i] for i in order]
    best = rows[0]
    pol = Policy(name="sita_tuned", kind="routing",
                 fn=make_sita_overflow(fits[best["fit"]], best["overflow_s"]),
                 info={"fit": fits[best["fit"]], "orientation": best["fit"],
                       "overflow_s": best["overflow_s"], "table": rows})
    return pol, rows


@register("sita_tuned", "routing")
def _sita_tuned_factory(env=None, params=None, key=None, fits=None, grid=None,
                           num_envs: int = 8, num_steps: int = 1024, warmup: int = 64):
    """SITA (on the predicted output length) that spills a request to the GPU that would
    finish it soonest when its group is congested; orientation (short requests on slow or fast
    GPUs) and threshold tuned on tuning streams (`tune_sita`, the candidates in
    `info["table"]`)."""
    if env is None or params is None:
        raise ValueError("policy 'sita_tuned' needs env= and params= (it simulates a grid)")
    pol, _ = tune_sita(env, params, key, fits, grid, num_envs, num_steps, warmup)
    return pol


# `tune_sita_burst`'s grids: the fast GPU's queued work in multiples of the mean request's
# service time alone on a mean-speed GPU (0: never, which is `sita_tuned`), and the mean
# output estimate of its requests in multiples of the workload's mean output (inf: any).
BURST_WORK_GRID = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
BURST_TOKENS_GRID = (0.25, 0.5, 1.0, 2.0, float("inf"))


def tune_sita_burst(env, params, key=None, work_grid=None, tokens_grid=None,
                    num_envs: int = 8, num_steps: int = 1024, warmup: int = 64):
    """SITA with overflow and a burst rule (`policies.routing.make_sita_burst`), fitted on
    tuning streams in two stages: `tune_sita` gives each orientation's best spill threshold,
    then one vmapped program evaluates every (orientation, work, tokens) triple of the burst
    rule with that threshold and keeps the lowest drop-inclusive mean latency (s; ties to the
    rule off, then the first orientation, then the smaller thresholds). The triples with
    work 0 are SITA with overflow alone, `sita_tuned`'s best among them, so on the tuning
    streams the result is never worse than `sita_tuned`. The orientation is chosen again
    here because the burst rule changes which is better (with short requests on the slow
    GPUs the rule can send them to a fast one in a burst; with short requests on the fast
    GPUs it has nothing to add).

    Args:
      env (Environment): a Routing-v0 environment.
      params (ServingParams): its parameters.
      key (jax.Array | None): as in `tune_sita` (default `tuning_key()`).
      work_grid (sequence of float | None): queued-work thresholds in seconds (default
        `BURST_WORK_GRID` times the mean request's `single_request_time`, averaged over GPUs).
      tokens_grid (sequence of float | None): mean-estimate thresholds in tokens (default
        `BURST_TOKENS_GRID` times the workload's mean output).
      num_envs, num_steps, warmup (int): as in `jaxserve.evaluate`.

    Returns:
      (`Policy` "sita_burst_tuned", table): one dict per candidate (`fit`, `overflow_s`,
        `burst_work_s`, `burst_tokens`, `mean_latency_incl_drops`, `mean_latency`,
        `dropped`), best first.
    """
    if not is_routing(env):
        raise ValueError("tune_sita_burst needs a Routing-v0 environment")
    key = tuning_key() if key is None else mark_tuning_key(key)
    p_mean, o_mean = workload_means(params)
    if work_grid is None:
        unit = float(np.mean(np.asarray(single_request_time(params.gpus, p_mean, o_mean))))
        work_grid = [g * unit for g in BURST_WORK_GRID]
    if tokens_grid is None:
        tokens_grid = [g * float(o_mean) for g in BURST_TOKENS_GRID]
    works = np.asarray([float(w) for w in work_grid], np.float32)
    toks = np.asarray([float(t) for t in tokens_grid], np.float32)
    for name, g in (("work_grid", works), ("tokens_grid", toks)):
        if g.ndim != 1 or g.size == 0 or np.any(np.isnan(g)) or np.any(g < 0):
            raise ValueError(f"tune_sita_burst: {name} must be a non-empty list of "
                             "thresholds >= 0 (inf allowed)")
    fits = {o: fit_sita(params, key=key, predictor="predicted", order=o)
            for o in ("slow_first", "fast_first")}
    _, spill_table = tune_sita(env, params, key, fits, None, num_envs, num_steps, warmup)
    names = list(fits)
    overflow = {n: next(r["overflow_s"] for r in spill_table if r["fit"] == n) for n in names}
    th, mask, coef = _stack_fits([fits[n] for n in names])
    cand_f, cand_w, cand_t = (a.ravel() for a in np.meshgrid(np.arange(len(names)), works, toks,
                                                             indexing="ij"))
    cand_o = np.asarray([overflow[names[i]] for i in cand_f], np.float32)
    streams, keys = make_streams(key, params, int(num_envs), int(num_steps), None)
    env_t = trace_env(env, streams.gap.shape[1])

    @jax.jit
    def run(params, streams, keys, th, mask, coef, o, w, t):
        def one(th, mask, coef, o, w, t):
            fit = SitaFit(thresholds=th, mask=mask, utilisation=None, max_rho_per_rate=None,
                          predictor=coef)
            return rollout_envs(env_t, make_sita_burst(fit, o, w, t), params, streams, keys,
                                True)
        return jax.vmap(one)(th, mask, coef, o, w, t)

    out = jax.device_get(run(params, streams, keys, th[cand_f], mask[cand_f], coef[cand_f],
                             cand_o, cand_w, cand_t))
    rows = []
    for i in range(cand_f.shape[0]):
        s = summarise(jax.tree.map(lambda x, i=i: x[i], out), streams, params, warmup)
        rows.append({"fit": names[cand_f[i]], "overflow_s": float(cand_o[i]),
                     "burst_work_s": float(cand_w[i]), "burst_tokens": float(cand_t[i]),
                     "mean_latency_incl_drops": s["mean_latency_incl_drops"],
                     "mean_latency": s["mean_latency"], "dropped": s["dropped"]})
    rows.sort(key=lambda r: (r["mean_latency_incl_drops"], r["burst_work_s"] > 0,
                             names.index(r["fit"]), r["burst_work_s"], r["burst_tokens"]))
    best = rows[0]
    fit = fits[best["fit"]]
    pol = Policy(name="sita_burst_tuned", kind="routing",
                 fn=make_sita_burst(fit, best["overflow_s"], best["burst_work_s"],
                                    best["burst_tokens"]),
                 info={"fit": fit, "orientation": best["fit"], "overflow_s": best["overflow_s"],
                       "burst_work_s": best["burst_work_s"],
                       "burst_tokens": best["burst_tokens"], "table": rows,
                       "spill_table": spill_table})
    return pol, rows


@register("sita_burst_tuned", "routing")
def _sita_burst_tuned_factory(env=None, params=None, key=None, work_grid=None,
                              tokens_grid=None, num_envs: int = 8, num_steps: int = 1024,
                              warmup: int = 64):
    """`sita_tuned` that sends a short request to the least-loaded fast GPU while that GPU
    holds little work of short requests (a burst rule); all thresholds fitted on tuning
    streams (`tune_sita_burst`, the candidates in `info["table"]`)."""
    if env is None or params is None:
        raise ValueError("policy 'sita_burst_tuned' needs env= and params= (it simulates "
                         "a grid)")
    pol, _ = tune_sita_burst(env, params, key, work_grid, tokens_grid, num_envs, num_steps,
                             warmup)
    return pol
