"""The SMDP-optimal batcher for one GPU with Poisson arrivals (Batching-v0's own model).

Formulation (semi-Markov decision process; Tijms, *A First Course in Stochastic Models*, ch. 7):

* Decision epochs: the GPU is idle and `q` requests wait (Batching-v0's decision instants),
  plus `q = 0` where the only action is to wait for the next arrival.
* State: `q in {0, ..., Q}`, `Q` the GPU's `queue_cap` (the environment's own cap on waiting
  requests, so the truncation is the environment's: arrivals to a full queue are dropped
  there as here, and cost `drop_penalty_s` each).
* Actions: `0` = wait (allowed for `1 <= q < wait_cap`, default `wait_cap = Q`; forced at
  `q = 0`): the next epoch is the next arrival, after `Exp(lambda)` seconds, in state `q + 1`.
  `k in 1..min(q, B)` = dispatch the first `k`: the GPU is busy for the batch's service time
  `T_k`, during which `N ~ Poisson(lambda T_k)` requests arrive; the next epoch is the
  completion, in state `min(q - k + N, Q)`.
* Service: `T_k = c0 + alpha sum p + alpha2 sum p^2 + max o (beta + gamma k + delta sum p)` over
  `k` requests with i.i.d. sizes from `params.tokens` (FIFO batches are i.i.d. draws): exact
  for fixed token sizes (one sample), Monte Carlo with `num_samples` batches otherwise; all
  quantities below are expectations over those samples.
* Cost of an epoch: the integral of the number in system (waiting + running) until the next
  epoch, plus `drop_penalty_s` per drop. Given `T`, with `m = q - k` waiting after dispatch,
  `E int_0^T min(m + N(t), Q) dt = (1/lambda) sum_{j>=0} min(m + j, Q) P(N(T) > j)` (the time
  spent at each level of a Poisson process), and `E drops = lambda T - sum_{j<Q-m} P(N(T) > j)`.
  The long-run average cost per unit time is then the mean number in system plus the drop
  penalty rate: `mean latency = L / (lambda - drop rate)` by Little's law, and the
  environment's reward rate up to its `latency_scale`.
* Solver: policy iteration (exact linear solves; starts from greedy dispatch, keeps the
  current action on ties) or relative value iteration on the Schweitzer-transformed MDP
  (`method="rvi"`), in float64.

Optimality: with fixed token sizes the queue length is a sufficient statistic (Poisson
arrivals are memoryless and the cost is linear in time-in-system, so how long the waiting
requests have waited does not change the future), so the table beats or ties every policy
that looks at waiting times as well, static (B, tau) included. With random sizes it is optimal
among policies that see only `q` (not the waiting requests' estimates). With MMPP arrivals it
uses the mean rate and is no longer optimal.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import poisson

from jaxserve.core import arrivals as A
from jaxserve.core.service import host_profile, service_time
from jaxserve.core.sources import mark_tuning_key, params_trace, sample_tokens_n, tuning_key
from jaxserve.policies.registry import Policy, register


class SMDPModel(NamedTuple):
    """Epoch quantities, indexed `[q, a]` (`a = 0` wait, `a = k` dispatch k).

    Attributes:
      rate: lambda (req/s). queue_cap: Q. max_batch: B.
      feasible: `(Q+1, B+1)` bool. tau: expected epoch length (s). cost: expected cost
      (request-seconds + penalty). area: expected request-seconds in system. drops: expected
      drops. trans: `(Q+1, B+1, Q+1)` next-state probabilities.
      service_mean: `(B+1,)` E[T_k] (s), index 0 unused. drop_penalty_s: the penalty used.
    """

    rate: float
    queue_cap: int
    max_batch: int
    feasible: np.ndarray
    tau: np.ndarray
    cost: np.ndarray
    area: np.ndarray
    drops: np.ndarray
    trans: np.ndarray
    service_mean: np.ndarray
    drop_penalty_s: float


class SMDPSolution(NamedTuple):
    """Solution of an `SMDPModel`.

    Attributes:
      table: `(Q+1,)` int32 action per queue length (0 = wait).
      gain: long-run average cost per second.
      bias: `(Q+1,)` relative values (bias[0] = 0).
      mean_in_system: time-average requests in system L; drop_rate: drops per second;
      mean_latency: L / (lambda - drop_rate) (s).
      iterations: solver iterations. method: "policy_iteration" or "rvi".
    """

    table: np.ndarray
    gain: float
    bias: np.ndarray
    mean_in_system: float
    drop_rate: float
    mean_latency: float
    iterations: int
    method: str


def batch_service_samples(params, num_samples: int = 2048, key=None) -> np.ndarray:
    """Service times `T[k, s]` (s) of FIFO batches of `k = 1..B` i.i.d. requests, `(B+1, S)`.

    Batches of different `k` share their first requests (nested samples). With fixed token
    sizes every sample is the same and `S = 1`.
    """
    key = tuning_key() if key is None else mark_tuning_key(key)  # never an evaluation key
    b = int(np.asarray(params.gpus.max_batch)[0])
    p, o = sample_tokens_n(key, params.tokens, num_samples * b)
    p = np.asarray(p, np.float64).reshape(num_samples, b)
    o = np.asarray(o, np.float64).reshape(num_samples, b)
    if np.ptp(p) == 0 and np.ptp(o) == 0:
        p, o = p[:1], o[:1]
    g = jax.tree.map(lambda x: x[0], host_profile(params.gpus))
    k = np.arange(1, b + 1, dtype=np.float64)
    sp, sp2, mo = np.cumsum(p, 1), np.cumsum(p * p, 1), np.maximum.accumulate(o, 1)
    t = service_time(g, k, sp, sp2, mo)  # (S, B)
    return np.concatenate([np.zeros((1, t.shape[0])), t.T], axis=0)


def build_model(params, key=None, num_samples: int = 2048, wait_cap: int | None = None,
                rate: float | None = None) -> SMDPModel:
    """The SMDP of Batching-v0 under `params` (see the module docstring).

    Args:
      params (ServingParams): Batching-v0's parameters (one GPU).
      key (jax.Array | None): Monte Carlo key for batch service times (unused draws for
        fixed sizes).
      num_samples: Monte Carlo draws of batch service times.
      wait_cap: waiting is allowed for `1 <= q < wait_cap` (default and maximum: `queue_cap`).
      rate: arrival rate (default: the mean rate of `params.arrivals`).
    """
    lam = float(np.asarray(A.mean_rate(params.arrivals))) if rate is None else float(rate)
    if not np.isfinite(lam) or lam <= 0:
        raise ValueError(f"the SMDP needs a positive arrival rate, got {lam}")
    qcap = int(np.asarray(params.gpus.queue_cap)[0])
    b = int(np.asarray(params.gpus.max_batch)[0])
    wait_cap = qcap if wait_cap is None else int(min(max(wait_cap, 1), qcap))
    pen = float(np.asarray(params.drop_penalty_s))
    t = batch_service_samples(params, num_samples, key)  # (B+1, S)
    n_s, n_a = qcap + 1, b + 1
    feasible = np.zeros((n_s, n_a), bool)
    tau = np.full((n_s, n_a), np.nan)
    cost, area, drops = (np.full((n_s, n_a), np.nan) for _ in range(3))
    trans = np.zeros((n_s, n_a, n_s))
    # Wait: forced at q = 0, allowed for 1 <= q < wait_cap.
    for q in range(n_s):
        if q == 0 or q < wait_cap:
            feasible[q, 0] = True
            tau[q, 0] = 1.0 / lam
            area[q, 0] = q / lam
            drops[q, 0] = 0.0
            trans[q, 0, min(q + 1, qcap)] = 1.0
    j = np.arange(n_s)
    for k in range(1, n_a):
        mu = lam * t[k]  # (S,) Poisson means
        pmf = poisson.pmf(j[:, None], mu[None, :]).mean(1)  # P(N = j), j = 0..Q
        sf = poisson.sf(j[:, None], mu[None, :]).mean(1)  # P(N > j)
        et = float(t[k].mean())
        for q in range(k, n_s):
            m = q - k
            r = qcap - m  # arrivals that fit
            below = sf[:r].sum()
            feasible[q, k] = True
            tau[q, k] = et
            drops[q, k] = max(lam * et - below, 0.0)
            area[q, k] = (k * et + ((m + j[:r]) * sf[:r]).sum() / lam
                          + qcap * drops[q, k] / lam)
            trans[q, k, m:m + r] = pmf[:r]
            trans[q, k, qcap] += max(1.0 - pmf[:r].sum(), 0.0)
    cost = area + pen * drops
    return SMDPModel(rate=lam, queue_cap=qcap, max_batch=b, feasible=feasible, tau=tau,
                     cost=cost, area=area, drops=drops, trans=trans, service_mean=t.mean(1),
                     drop_penalty_s=pen)


def _policy_arrays(model: SMDPModel, table):
    s = np.arange(model.queue_cap + 1)
    if not np.all(model.feasible[s, table]):
        bad = int(np.flatnonzero(~model.feasible[s, table])[0])
        raise ValueError(f"action {table[bad]} is not feasible in state q={bad}")
    return model.tau[s, table], model.cost[s, table], model.trans[s, table]


def policy_stats(model: SMDPModel, table) -> dict:
    """Exact long-run averages of a queue-length table policy (must be unichain).

    Returns:
      dict: gain (cost per second), bias `(Q+1,)`, mean_in_system, drop_rate, mean_latency.
    """
    table = np.asarray(table, np.int64)
    tau, cost, p = _policy_arrays(model, table)
    n = tau.shape[0]
    a = np.eye(n) - p
    a[:, 0] = tau  # unknowns: g (in h[0]'s column, as h[0] = 0), h[1..Q]
    x = np.linalg.solve(a, cost)
    gain, bias = float(x[0]), np.concatenate([[0.0], x[1:]])
    # Stationary law of the embedded chain: pi (P - I) = 0, sum pi = 1.
    m = (p - np.eye(n)).T
    m[-1] = 1.0
    rhs = np.zeros(n)
    rhs[-1] = 1.0
    pi = np.clip(np.linalg.solve(m, rhs), 0.0, None)
    s = np.arange(n)
    time = (pi * tau).sum()
    lin = (pi * model.area[s, table]).sum() / time
    drop_rate = (pi * model.drops[s, table]).sum() / time
    return {"gain": gain, "bias": bias, "mean_in_system": float(lin),
            "drop_rate": float(drop_rate),
            "mean_latency": float(lin / max(model.rate - drop_rate, 1e-300))}


def _q_values(model: SMDPModel, gain: float, bias: np.ndarray) -> np.ndarray:
    qv = model.cost - gain * model.tau + model.trans @ bias
    return np.where(model.feasible, qv, np.inf)


def greedy_table(model: SMDPModel, max_batch: int | None = None) -> np.ndarray:
    """Dispatch `min(q, B')` whenever `q >= 1` (the static batcher with tau = 0)."""
    b = model.max_batch if max_batch is None else int(min(max_batch, model.max_batch))
    return np.minimum(np.arange(model.queue_cap + 1), b)


def solve_smdp(model: SMDPModel, method: str = "policy_iteration", tol: float = 1e-10,
               max_iter: int = 100_000) -> SMDPSolution:
    """Minimises the long-run average cost of `model`; returns the optimal table and stats."""
    if method == "policy_iteration":
        table = greedy_table(model)
        for it in range(1, 1000):
            st = policy_stats(model, table)
            qv = _q_values(model, st["gain"], st["bias"])
            best = qv.min(1)
            cur = qv[np.arange(qv.shape[0]), table]
            scale = max(np.abs(best).max(), 1.0)
            new = np.where(cur <= best + 1e-12 * scale, table, qv.argmin(1))
            if np.array_equal(new, table):
                break
            table = new
    elif method == "rvi":
        tau = np.where(model.feasible, model.tau, 1.0)
        eta = 0.5 * tau[model.feasible].min()
        c_bar = np.where(model.feasible, model.cost / tau, np.inf)
        h = np.zeros(model.queue_cap + 1)
        for it in range(1, max_iter + 1):
            th = c_bar + (eta / tau) * (model.trans @ h - h[:, None]) + h[:, None]
            th = np.where(model.feasible, th, np.inf)
            v = th.min(1)
            diff = v - h
            lo, hi = diff.min(), diff.max()
            h = v - v[0]
            if hi - lo <= tol * max(abs(lo), 1e-12):
                break
        table = th.argmin(1)
        st = policy_stats(model, table)
    else:
        raise ValueError(f"method must be 'policy_iteration' or 'rvi', got {method!r}")
    return SMDPSolution(table=table.astype(np.int32), gain=st["gain"], bias=st["bias"],
                        mean_in_system=st["mean_in_system"], drop_rate=st["drop_rate"],
                        mean_latency=st["mean_latency"], iterations=it, method=method)


def make_table_policy(table):
    """`policy(key, obs, state, params)` acting by a queue-length table (q -> action)."""
    t = jnp.asarray(np.asarray(table), jnp.int32)

    def smdp_table(key, obs, state, params):
        q = state.cluster.queues.count[0]
        return t[jnp.minimum(q, t.shape[0] - 1)]

    return smdp_table


@register("smdp_optimal", "batching")
def _smdp_factory(env=None, params=None, key=None, num_samples: int = 2048,
                  wait_cap: int | None = None, rate: float | None = None,
                  method: str = "policy_iteration"):
    """The SMDP-optimal queue-length table for `params` (see the module docstring).

    With a trace in `params` the model uses the trace's mean rate and its token rows.
    """
    if params is None:
        raise ValueError("policy 'smdp_optimal' needs params=")
    if int(np.asarray(params.gpus.c0).shape[0]) != 1:
        raise ValueError("smdp_optimal is a single-GPU batcher (Batching-v0)")
    tr = params_trace(params)
    note = None
    if tr is not None:
        span = float(tr.arrival_s[-1] - tr.arrival_s[0])
        if rate is None:
            rate = (len(tr) - 1) / span if span > 0 else float(len(tr))
        params = params.replace(tokens=A.empirical_tokens(tr.prompt_tokens, tr.output_tokens))
        note = "fitted to the trace's mean rate and token rows (Poisson assumed)"
    elif params.arrivals.rates.shape[-1] > 1:
        note = "MMPP arrivals: solved for the mean rate; optimal only for Poisson"
    model = build_model(params, key, num_samples, wait_cap, rate)
    sol = solve_smdp(model, method)
    return Policy(name="smdp_optimal", kind="batching", fn=make_table_policy(sol.table),
                  info={"table": sol.table, "gain": sol.gain, "mean_latency": sol.mean_latency,
                        "rate": model.rate, "note": note, "solution": sol, "model": model})


def static_table_gains(model: SMDPModel) -> dict[str, float]:
    """Exact long-run cost rates of the static (B, tau) rules that are queue-length tables.

    `greedy B` = static(B, 0), dispatch `min(q, B)` whenever `q >= 1`; `wait B` =
    static(B, inf), dispatch exactly `B` once `B` wait. Finite `tau > 0` rules look at the
    head's wait, so they are not tables (simulate them: `evaluation.tune_static`). As these
    rules belong to the static family, `min(these) / optimum gain - 1` is an upper bound on
    what the optimum gains over the best static rule (exact, no simulation noise).

    Returns:
      `{"greedy B": gain, "wait B": gain}` (cost per second, as `SMDPSolution.gain`) for B
      in 1..max_batch.
    """
    q = np.arange(model.queue_cap + 1)
    out = {}
    for b in range(1, model.max_batch + 1):
        out[f"greedy {b}"] = policy_stats(model, np.minimum(q, b))["gain"]
        out[f"wait {b}"] = policy_stats(model, np.where(q >= b, b, 0))["gain"]
    return out
