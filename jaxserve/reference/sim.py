"""Event-by-event reference simulator of the serving-cluster model in `docs/contract_static.md`.

This is the ground truth the JAX engine is tested against. It is deliberately plain Python
(numpy only for the returned arrays), float64 throughout, and follows MODEL.md literally:

* Service time of a static batch `S` (seconds):
  `T(S) = c0 + alpha*sum p + alpha2*sum p^2 + max o * (beta + gamma*|S| + delta*sum p)`;
  every request of the batch starts when the batch is dispatched and finishes when it ends.
* One FIFO queue per GPU. A request routed to a GPU whose queue already holds `queue_cap`
  *waiting* requests (the running batch not counted) is dropped.
* Static batcher: an idle GPU with `q` waiting requests dispatches the first `min(q, B)` as soon
  as `q >= B` or at the head's deadline `a_head + tau` (float64), whichever comes first; a GPU
  that becomes idle with the deadline already passed (or with `q >= B`) dispatches at once.
  `tau = 0` is greedy.
* Event order at one timestamp `t`: (1) all batch completions at `t`, (2) all arrivals at `t`,
  in index order (each joins its queue or is dropped), (3) dispatch decisions. So arrivals at
  exactly `t` join before a dispatch that fires at `t` and can ride in that batch (up to `B`);
  conversely, an arrival at `t` to a queue holding `Q` waiting requests is dropped even if those
  requests are dispatched at `t`.
* Readings written down here (MODEL.md is silent on them): when several GPUs dispatch at the
  same instant, global batch ids follow ascending GPU index. A batch with `T = 0` (all
  coefficients zero) completes at its own dispatch instant; the loop then runs that instant
  again (completion, no new arrivals, decision), so the GPU may dispatch again at once.

Times are seconds, token counts are integers.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque

import numpy as np

PROFILE_KEYS = ("c0", "alpha", "alpha2", "beta", "gamma", "delta", "max_batch", "queue_cap",
                "timeout")

# Heap event kinds. Their relative order does not matter: every event at an instant is popped
# before that instant's arrivals and decisions are processed.
_COMPLETION = 0  # a batch ends; its GPU becomes idle
_TIMER = 1  # a static batcher deadline a_head + tau: re-examine that GPU


def _get(profile, key):
    """Reads `key` from a dict-like or attribute-style profile."""
    if isinstance(profile, dict):
        return profile[key]
    return getattr(profile, key)


def _profile_tuple(profile):
    """Returns a profile as plain Python numbers: floats (s, s/token, ...) and ints (B, Q)."""
    c0, alpha, alpha2, beta, gamma, delta = (float(_get(profile, k)) for k in PROFILE_KEYS[:6])
    max_batch = int(_get(profile, "max_batch"))
    queue_cap = int(_get(profile, "queue_cap"))
    timeout = float(_get(profile, "timeout"))
    if max_batch < 1 or queue_cap < 1:
        raise ValueError("max_batch and queue_cap must be >= 1")
    return c0, alpha, alpha2, beta, gamma, delta, max_batch, queue_cap, timeout


def service_time(prompts, outputs, profile):
    """Service time (s) of one static batch with the given prompt/output token counts.

    `T = c0 + alpha*sum p + alpha2*sum p^2 + max o * (beta + gamma*|S| + delta*sum p)`.
    """
    c0, alpha, alpha2, beta, gamma, delta = (float(_get(profile, k)) for k in PROFILE_KEYS[:6])
    return _service_time([float(p) for p in prompts], [float(o) for o in outputs],
                         c0, alpha, alpha2, beta, gamma, delta)


def _service_time(ps, os_, c0, alpha, alpha2, beta, gamma, delta):
    sp = 0.0
    sp2 = 0.0
    for p in ps:
        sp += p
        sp2 += p * p
    return c0 + alpha * sp + alpha2 * sp2 + max(os_) * (beta + gamma * len(ps) + delta * sp)


def _check_inputs(arrival, prompt, output):
    arrival = np.asarray(arrival, dtype=np.float64)
    prompt = np.asarray(prompt)
    output = np.asarray(output)
    n = arrival.shape[0]
    if arrival.ndim != 1 or prompt.shape != (n,) or output.shape != (n,):
        raise ValueError("arrival, prompt, output must be 1-D arrays of equal length")
    if n and (not np.all(np.isfinite(arrival)) or np.any(np.diff(arrival) < 0)):
        raise ValueError("arrival must be finite and non-decreasing")
    if n and (np.any(prompt < 1) or np.any(output < 1)):
        raise ValueError("prompt and output lengths must be >= 1")
    return arrival, prompt, output, n


def _run(arrival, prompt, output, gpu, profs, horizon, decide_fn):
    """Shared event loop.

    `decide_fn(g, now, queue, has_more_arrivals)` returns how many requests GPU `g` (idle,
    non-empty FIFO `queue` of request ids, a deque) dispatches now (0 = none; capped at the
    queue length), plus an optional timer time (s) at which GPU `g` must be re-examined even
    if nothing else happens (None = no timer).
    """
    n = len(arrival)
    num_gpus = len(profs)
    # Plain Python lists are much faster to index than numpy arrays in a scalar loop.
    a = arrival.tolist()
    p = [float(x) for x in prompt.tolist()]
    o = [float(x) for x in output.tolist()]
    g_of = [int(x) for x in gpu.tolist()]

    start = [math.nan] * n
    finish = [math.nan] * n
    dropped = [False] * n
    batch_of = [-1] * n
    batches = []

    queues = [deque() for _ in range(num_gpus)]  # FIFO of waiting request ids
    busy = [False] * num_gpus
    pending_timer = [None] * num_gpus  # time of the live timer entry per GPU, if any
    heap = []  # (time, kind, gpu)
    nxt = 0  # next arrival index
    inf = math.inf
    limit = inf if horizon is None else float(horizon)
    heappush, heappop = heapq.heappush, heapq.heappop

    while True:
        t_arr = a[nxt] if nxt < n and a[nxt] <= limit else inf
        t_evt = heap[0][0] if heap else inf
        now = t_arr if t_arr < t_evt else t_evt  # next event instant
        if now == inf:
            break
        touched = []  # GPUs whose state changed at `now`
        # (1) completions (and timers) at `now`: completions free their GPU.
        while heap and heap[0][0] == now:
            _, kind, g = heappop(heap)
            if kind == _COMPLETION:
                busy[g] = False
            elif pending_timer[g] == now:
                pending_timer[g] = None
            touched.append(g)
        # (2) all arrivals at `now`, in index order.
        if now > limit:
            # Past the horizon only completions matter; no more dispatches.
            continue
        while nxt < n and a[nxt] == now:
            g = g_of[nxt]
            q = queues[g]
            if len(q) >= profs[g][7]:
                dropped[nxt] = True
            else:
                q.append(nxt)
            touched.append(g)
            nxt += 1
        more = nxt < n and a[nxt] <= limit
        # (3) dispatch decisions, ascending GPU index.
        if len(touched) > 1:
            touched = sorted(set(touched))
        for g in touched:
            q = queues[g]
            if busy[g] or not q:
                continue
            k, timer = decide_fn(g, now, q, more)
            if k > 0:
                ids = [q.popleft() for _ in range(min(k, len(q)))]
                c0, alpha, alpha2, beta, gamma, delta = profs[g][:6]
                dur = _service_time([p[i] for i in ids], [o[i] for i in ids],
                                    c0, alpha, alpha2, beta, gamma, delta)
                end = now + dur
                bid = len(batches)
                for i in ids:
                    start[i] = now
                    finish[i] = end
                    batch_of[i] = bid
                batches.append((g, now, end, ids))
                busy[g] = True
                heappush(heap, (end, _COMPLETION, g))
            elif timer is not None and timer <= limit and pending_timer[g] != timer:
                pending_timer[g] = timer
                heappush(heap, (timer, _TIMER, g))

    return {
        "start": np.asarray(start, dtype=np.float64),
        "finish": np.asarray(finish, dtype=np.float64),
        "dropped": np.asarray(dropped, dtype=bool),
        "batch": np.asarray(batch_of, dtype=np.int64),
        "batches": batches,
    }


def simulate(arrival, prompt, output, gpu, profiles, horizon=None):
    """Discrete-event simulation of a cluster of static-batching GPUs (MODEL.md v0).

    Args:
      arrival: `(n,)` arrival times (s), finite, non-decreasing.
      prompt, output: `(n,)` prompt / output lengths (tokens), integers >= 1.
      gpu: `(n,)` routing decision: request `i` joins GPU `gpu[i]`'s FIFO queue at `arrival[i]`.
      profiles: one profile per GPU, a dict or an object with attributes `c0, alpha, alpha2,
        beta, gamma, delta, max_batch, queue_cap, timeout` (units as in MODEL.md).
      horizon: optional time (s). If given, arrivals after it are ignored (start/finish NaN,
        not dropped, batch -1) and no batch is dispatched after it; batches dispatched at or
        before it run to completion (their finish may exceed the horizon). If None, the run
        continues until the system is drained (every non-dropped request finished).

    Returns:
      dict with `(n,)` numpy arrays `start` and `finish` (float64 s, NaN if never dispatched),
      `dropped` (bool), `batch` (int64 global batch id in dispatch order, -1 if never
      dispatched), and `batches`: list of `(gpu, start_s, finish_s, [request ids])` in dispatch
      order (same-instant dispatches on several GPUs are ordered by GPU index).
    """
    arrival, prompt, output, n = _check_inputs(arrival, prompt, output)
    gpu = np.asarray(gpu)
    profs = [_profile_tuple(pr) for pr in profiles]
    if gpu.shape != (n,):
        raise ValueError("gpu must have shape (n,)")
    if n and (np.any(gpu < 0) or np.any(gpu >= len(profs))):
        raise ValueError("gpu ids must lie in [0, len(profiles))")

    def static_batcher(g, now, q, more):
        max_batch, tau = profs[g][6], profs[g][8]
        waiting = len(q)
        deadline = arrival_list[q[0]] + tau  # float64
        if waiting >= max_batch or deadline <= now:
            return min(waiting, max_batch), None
        return 0, deadline

    arrival_list = arrival.tolist()
    return _run(arrival, prompt, output, gpu, profs, horizon, static_batcher)


def simulate_batching(arrival, prompt, output, profile, decide):
    """Single-GPU simulation where a callback replaces the static batcher.

    At each decision instant (GPU idle, queue non-empty, after all completions and arrivals at
    that instant) calls `k = decide(now, queue_arrivals, queue_prompts, queue_outputs)` with
    Python lists of the waiting requests in FIFO order. `k >= 1` dispatches the first
    `min(k, q, max_batch)` requests; `k == 0` waits: the next decision is taken at the next
    arrival instant (after that arrival joins or is dropped). If no arrivals remain and `k == 0`,
    `min(q, max_batch)` requests are dispatched at once. `queue_cap` drops apply; `timeout` is
    ignored. Units and return format as `simulate` (all batches on GPU 0).
    """
    arrival, prompt, output, n = _check_inputs(arrival, prompt, output)
    profs = [_profile_tuple(profile)]
    a_list = arrival.tolist()
    p_list = [int(x) for x in np.asarray(prompt).tolist()]
    o_list = [int(x) for x in np.asarray(output).tolist()]
    max_batch = profs[0][6]

    def agent_batcher(g, now, q, more):
        ids = list(q)
        k = int(decide(now, [a_list[i] for i in ids], [p_list[i] for i in ids],
                       [o_list[i] for i in ids]))
        if k < 0:
            raise ValueError(f"decide returned {k} < 0")
        if k == 0 and not more:
            k = max_batch
        return min(k, len(ids), max_batch), None

    return _run(arrival, prompt, output, np.zeros(n, dtype=np.int64), profs, None,
                agent_batcher)


def mg1_mean_wait(lam, es, es2):
    """Pollaczek-Khinchine mean wait in queue (s) of an M/G/1 queue.

    `W = lam * E[S^2] / (2 * (1 - rho))`, `rho = lam * E[S]`; `lam` in requests/s, `es` in s,
    `es2` in s^2. Raises ValueError if `rho >= 1` (no steady state).
    """
    rho = lam * es
    if rho >= 1.0:
        raise ValueError(f"rho = {rho} >= 1: the queue is unstable")
    return lam * es2 / (2.0 * (1.0 - rho))


def _timing(n=1_000_000, num_gpus=4, seed=0):
    """Times `simulate` on a random `n`-request, `num_gpus`-GPU instance; returns wall seconds."""

    rng = np.random.default_rng(seed)
    prof = dict(c0=0.01, alpha=1e-5, alpha2=1e-9, beta=0.002, gamma=1e-4, delta=1e-7,
                max_batch=8, queue_cap=64, timeout=0.05)
    prompt = rng.integers(1, 513, n)
    output = rng.integers(1, 129, n)
    arrival = np.cumsum(rng.exponential(1.0 / (num_gpus * 8.0), n))
    gpu = rng.integers(0, num_gpus, n)
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(arrival, prompt, output, gpu, [prof] * num_gpus)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"{n} requests, {num_gpus} GPUs: {dt:.2f} s wall, {cpu:.2f} s CPU; "
          f"{len(res['batches'])} batches, {int(res['dropped'].sum())} dropped")
    return dt


if __name__ == "__main__":
    _timing()
