"""Load sweeps and SLO capacity: the highest arrival rate a policy serves within a p99 SLO.

Both vmap the evaluation rollout over arrival rates (`params.arrivals.rates` is an array
leaf): one compiled program evaluates every candidate rate, for every policy, on every
environment. Requests are drawn per rate from the same keys, so for Poisson arrivals the
streams at different rates are the same exponential draws rescaled (a monotone coupling: the
p99 curve is not made jagged by sampling noise across rates). An MMPP's phase rates are
scaled together, keeping its burstiness; rates are reported as mean rates.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core import arrivals as A
from jaxserve.core.service import full_batch_rate, host_profile, service_time
from jaxserve.core.sources import params_trace, sample_stream, sample_tokens_n
from jaxserve.evaluation.evaluate import (_check_args, rollout_envs, summarise, switch_policy,
                                          trace_env)
from jaxserve.core.stats import percentile_with_drops, percentiles


def p99_with_drops(result_out_lat: np.ndarray) -> float:
    """p99 (linear interpolation) of latencies where NaN (dropped) counts as infinitely late."""
    return percentile_with_drops(result_out_lat, 99)


def service_capacity(params, num_samples: int = 512, key=None) -> float:
    """Rough cluster capacity (req/s): sum over GPUs of `B / E[T(full batch)]`."""
    key = jax.random.PRNGKey(0) if key is None else key
    b_max = int(np.asarray(params.gpus.max_batch).max())
    p, o = sample_tokens_n(key, params.tokens, num_samples * b_max, params.arrivals)
    p = np.asarray(p, np.float64).reshape(num_samples, b_max)
    o = np.asarray(o, np.float64).reshape(num_samples, b_max)
    return float(full_batch_rate(params.gpus, p, o).sum())


def p99_lower_bound(params, num_samples: int = 4096, key=None) -> float:
    """A lower bound of any policy's p99 latency (s): the p99, over the workload, of a request's
    service time alone on the fastest GPU for it (no waiting, no batch-mates)."""
    key = jax.random.PRNGKey(1) if key is None else key
    p, o = sample_tokens_n(key, params.tokens, num_samples, params.arrivals)
    p = np.asarray(p, np.float64)[:, None]
    o = np.asarray(o, np.float64)[:, None]
    t = service_time(host_profile(params.gpus), 1, p, p * p, o)  # (num_samples, num_gpus)
    # The 99th percentile of the sample, less 1% slack for sampling error.
    return float(0.99 * percentiles(t.min(axis=1), [99])[0])


def check_slo(params, slo_p99_s: float) -> float:
    """Validates a p99 SLO (s); ValueError if it is not positive or below `p99_lower_bound`."""
    slo = float(slo_p99_s)
    if not np.isfinite(slo) or slo <= 0:
        raise ValueError(f"slo_p99_s must be a positive number of seconds, got {slo_p99_s}")
    bound = p99_lower_bound(params)
    if slo < bound:
        raise ValueError(f"SLO p99 <= {slo:g} s is impossible: even served alone on the fastest "
                         f"GPU, 1% of requests take longer than {bound:.3g} s")
    return slo


@partial(jax.jit, static_argnames=("env_t", "policies", "routing", "n"))
def _run_sweep(env_t, policies, params, scales, stream_keys, keys, routing, n):
    """`(R, P, E, ...)` rollouts and `(R, E, n)` streams, all rates and policies at once."""
    def per_rate(scale):
        arr = params.arrivals
        p = params.replace(arrivals=arr.replace(rates=arr.rates * scale))
        streams = jax.vmap(sample_stream, in_axes=(0, None, None))(stream_keys, p, n)

        def per_policy(i):
            return rollout_envs(env_t, switch_policy(policies, i), p, streams, keys,
                                  routing)
        return jax.vmap(per_policy)(jnp.arange(len(policies))), streams
    return jax.vmap(per_rate)(scales)


def _sweep_raw(env, params, policies, rates, key, num_envs, num_steps, warmup):
    routing = _check_args(env, params, num_envs, num_steps, warmup)
    if params_trace(params) is not None:
        raise ValueError("load sweeps and capacity need synthetic arrivals, not a trace")
    rates = np.asarray(rates, np.float64)
    if rates.ndim != 1 or rates.size == 0 or np.any(~np.isfinite(rates)) or np.any(rates <= 0):
        raise ValueError(f"rates must be a non-empty 1-D array of positive rates, got {rates}")
    base = float(np.asarray(A.mean_rate(params.arrivals)))
    k_stream, k_roll = jax.random.split(key)
    stream_keys = jax.random.split(k_stream, int(num_envs))
    keys = jax.random.split(k_roll, int(num_envs))
    env_t = trace_env(env, int(num_steps))
    scales = jnp.asarray(rates / base, jnp.float32)
    out, streams = _run_sweep(env_t, tuple(policies), params, scales, stream_keys, keys,
                              routing, int(num_steps))
    return jax.device_get(out), jax.device_get(streams)


def sweep_rates(env, params, policies: Mapping[str, Callable], rates, key, num_envs: int = 8,
                num_steps: int = 500, *, warmup: int = 0) -> dict[str, list[dict]]:
    """Evaluates every policy at every mean arrival rate in `rates` (one program, CRN).

    Returns:
      `{name: [metrics at rates[0], ...]}`: each as `jaxserve.evaluate`'s, plus `rate` and
      `p99_with_drops` (dropped requests counted as infinitely late).
    """
    out, streams = _sweep_raw(env, params, list(policies.values()), rates, key, num_envs,
                              num_steps, warmup)
    res = {name: [] for name in policies}
    for r, rate in enumerate(np.asarray(rates, np.float64)):
        st = jax.tree.map(lambda x, r=r: x[r], streams)
        for i, name in enumerate(policies):
            o = jax.tree.map(lambda x, r=r, i=i: x[r, i], out)
            m = summarise(o, st, params, warmup)
            m["rate"] = float(rate)
            m["p99_with_drops"] = p99_with_drops(
                (np.asarray(o["wait"], np.float64) + o["service"])[:, warmup:])
            res[name].append(m)
    return res


def capacity(env, params, policy: Callable, slo_p99_s: float, key=None, num_envs: int = 8,
             num_steps: int = 500, *, warmup: int = 0, rate_lo: float | None = None,
             rate_hi: float | None = None, candidates: int = 8, rtol: float = 0.02,
             max_rounds: int = 6) -> dict:
    """Highest mean arrival rate at which the policy's p99 latency stays within `slo_p99_s`.

    p99 is exact over all measured requests of all environments, with dropped requests counted
    as infinitely late (a policy cannot meet the SLO by dropping). Bisection, vmapped: each
    round evaluates `candidates` rates spread over the current bracket in one program (so the
    bracket shrinks by `candidates + 1` per round); the new bracket is the first failing
    candidate and the one before it. Stops when the bracket is narrower than `rtol` (relative)
    or after `max_rounds`. The default upper end is 1.5 x `service_capacity(params)`; if the
    SLO still holds there the bracket is doubled (up to three times).

    Returns:
      dict: `rate` (req/s, the highest rate that met the SLO), `p99_latency` there,
      `slo_p99_s`, `bracket` (lo, hi), `bracketed` (False if the SLO held at the largest rate
      tried), `history` (list of (rate, p99) evaluated), `rounds`.

    Raises:
      ValueError: a non-positive or non-finite SLO, or an impossible one: below
        `p99_lower_bound` (checked before simulating), or missed even at `rate_lo` (default
        1/1000 of the upper end, where there is essentially no queueing).
    """
    if params_trace(params) is not None:
        raise ValueError("capacity needs synthetic arrivals, not a trace")
    slo = check_slo(params, slo_p99_s)
    if int(candidates) < 2:
        raise ValueError(f"candidates must be >= 2, got {candidates}")
    key = jax.random.PRNGKey(0) if key is None else key
    hi = 1.5 * service_capacity(params) if rate_hi is None else float(rate_hi)
    lo = hi * 1e-3 if rate_lo is None else float(rate_lo)
    if not (0 < lo < hi):
        raise ValueError(f"need 0 < rate_lo < rate_hi, got {lo}, {hi}")
    history: list[tuple[float, float]] = []

    def p99s(rates):
        out, _ = _sweep_raw(env, params, [policy], rates, key, num_envs, num_steps, warmup)
        lat = np.asarray(out["wait"], np.float64) + out["service"]  # (R, 1, E, n)
        vals = [p99_with_drops(lat[r, 0][:, warmup:]) for r in range(len(rates))]
        history.extend(zip(map(float, rates), vals))
        return np.asarray(vals)

    rates = np.linspace(lo, hi, int(candidates))
    vals = p99s(rates)
    if vals[0] > slo:
        raise ValueError(
            f"SLO p99 <= {slo:g} s is impossible: even at {rates[0]:.3g} req/s (almost no "
            f"queueing) the p99 latency is {vals[0]:.3g} s")
    rounds, bracketed = 1, True
    for _ in range(3):
        if np.all(vals <= slo):
            lo, hi = hi, 2.0 * hi
            rates = np.linspace(lo, hi, int(candidates))
            vals = p99s(rates)
            rounds += 1
    if np.all(vals <= slo):
        bracketed = False
        return {"rate": float(rates[-1]), "p99_latency": float(vals[-1]), "slo_p99_s": slo,
                "bracket": (float(rates[-1]), float("inf")), "bracketed": bracketed,
                "history": history, "rounds": rounds}
    while True:
        bad = int(np.argmax(vals > slo))
        lo_r, lo_v = float(rates[bad - 1]), float(vals[bad - 1])
        hi_r = float(rates[bad])
        if (hi_r - lo_r) <= rtol * hi_r or rounds >= max_rounds:
            break
        inner = np.linspace(lo_r, hi_r, int(candidates) + 2)[1:-1]
        inner_v = p99s(inner)
        rates = np.concatenate([[lo_r], inner, [hi_r]])
        vals = np.concatenate([[lo_v], inner_v, [np.inf]])
        rounds += 1
    return {"rate": lo_r, "p99_latency": lo_v, "slo_p99_s": slo, "bracket": (lo_r, hi_r),
            "bracketed": bracketed, "history": history, "rounds": rounds}
