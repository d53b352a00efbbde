"""Replay of a workload with given routes on the disaggregation engine (`core.disaggregation`):
the JAX counterpart of `jaxserve/reference/disaggregation.py`'s `simulate`, returning the same
per-request fields and per-pool counters.

`replay_arrays` is the pure, jittable and vmappable core (one `lax.scan` over the requests:
route the request arriving now, advance to the next arrival, rebase); `simulate_disagg` is the
host entry point: it validates the configuration, sizes the static shapes so that nothing can
overflow, runs the core under `jit` and returns numpy arrays with absolute times.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core import disaggregation as PD
from jaxserve.core import queues as Q
from jaxserve.core.replica import ReplicaProfile
from jaxserve.core.types import MAX_TOKENS


def replay_arrays(prof: ReplicaProfile, is_prefill: jax.Array, link: PD.Link, gap: jax.Array,
                  prompt: jax.Array, output: jax.Array, p_route: jax.Array, d_route: jax.Array,
                  sizes: tuple, router=None) -> dict:
    """Replays `N` requests: request `i` arrives `gap[i - 1]` s after request `i - 1`
    (`gap[N - 1] = inf`: the cluster drains after the last), with `prompt`, `output` tokens,
    P replica `p_route[i]` (-1: not disaggregated) and D replica `d_route[i]` (pool
    indices). `prof`: `disaggregation.pool_profile`'s, its rows P replicas where
    `is_prefill` (a traced `(R,)` bool: pools of any split share one compilation).

    `sizes` (static): `(queue_buffer, max_seqs, remote_slots, transfer_slots, width)`
    (`disaggregation.empty_pd`, `advance`'s `width`).

    `router` (static, optional) replaces the routes by a rule of what a router may observe
    (the step-wise use of the engine an environment makes): `router(views, prompt) ->
    (p_idx, d_idx)`, with `views` `disaggregation.replica_views`' dict at the request's
    arrival (after the ends at that instant and the earlier arrivals of it) and `prompt` its
    prompt tokens; pool indices, `p_idx` -1 for not disaggregated. The routes taken are
    returned as `p_route`, `d_route`.

    Returns a dict of `(N,)` arrays: spans from arrival (s, NaN where it did not happen)
    `prefill_done`, `transfer_start`, `transfer_end`, `first_token`, `finish`; `preemptions`
    (P and D), `dropped`, `never_fit`; and the final `pool` (`Replicas`) and `overflow`.
    """
    qb, seqs, xs, ts, width = sizes
    n = gap.shape[0]
    r = is_prefill.shape[0]
    st = PD.empty_pd(0, r, queue_buffer=qb, max_seqs=seqs, remote_slots=xs, transfer_slots=ts,
                     num_requests=n).replace(is_prefill=is_prefill)
    log = PD.empty_pd_log(n)

    def step(carry, x):
        st, log = carry
        i, g, p, o, pr, dr = x
        req = Q.Request(arrival=jnp.float32(0.0), prompt=p.astype(jnp.float32),
                        output=o.astype(jnp.float32), estimate=jnp.float32(0.0),
                        size_class=jnp.int32(0), req_id=i)
        if router is not None:
            pr, dr = router(PD.replica_views(st, prof), p)
            pr, dr = jnp.asarray(pr, jnp.int32), jnp.asarray(dr, jnp.int32)
        st, dropped, never = PD.route(st, prof, req, pr, dr)
        st, log, _ = PD.advance(st, prof, link, g, log, width)
        st = PD.rebase(st, jnp.where(jnp.isfinite(g), g, 0.0))
        return (st, log), (dropped, never, pr, dr)

    xs_in = (jnp.arange(n, dtype=jnp.int32), gap.astype(jnp.float32),
             prompt.astype(jnp.int32), output.astype(jnp.int32), p_route.astype(jnp.int32),
             d_route.astype(jnp.int32))
    (st, log), (dropped, never, p_taken, d_taken) = jax.lax.scan(step, (st, log), xs_in)
    # The log takes a request's preemptions when it finishes; one that never does (on a
    # replica that stalled for good: `docs/disaggregation.md` section 8, step 3) keeps them
    # in its running or waiting slot.
    pre = _unfinished_preemptions(st.pool, log.requests.preemptions)
    lg = log.requests
    return {"prefill_done": lg.e2e[n:], "transfer_start": log.transfer_start,
            "transfer_end": log.transfer_end, "first_token": lg.ttft[:n],
            "finish": lg.e2e[:n], "preemptions": pre[:n] + pre[n:],
            "dropped": dropped, "never_fit": never, "pool": st.pool, "overflow": st.overflow,
            "p_route": p_taken, "d_route": d_taken}


def _unfinished_preemptions(rep, logged: jax.Array) -> jax.Array:
    """`logged` with the preemptions of the requests still running or waiting in `rep`."""
    size = logged.shape[0]
    run = rep.run
    valid = jnp.arange(rep.max_seqs)[None, :] < run.count[:, None]
    logged = logged.at[jnp.where(valid, run.req_id, size).ravel()].set(run.pre.ravel(),
                                                                        mode="drop")
    waiting = Q.waiting_mask(rep.queues)
    return logged.at[jnp.where(waiting, rep.queues.req_id, size).ravel()].set(
        rep.q_pre.ravel(), mode="drop")


def _profiles(profiles, name: str) -> list:
    profiles = list(profiles)
    for k, p in enumerate(profiles):
        if not isinstance(p, ReplicaProfile):
            raise ValueError(f"{name}[{k}] must be a ReplicaProfile, got {type(p).__name__}")
    return profiles


def replay_sizes(prefill_profiles: Sequence[ReplicaProfile],
                 decode_profiles: Sequence[ReplicaProfile], num_requests: int) -> tuple:
    """Static sizes (`replay_arrays`' `sizes`) with which a replay of `num_requests` requests
    cannot overflow: waiting buffers hold the largest queue cap and every request (pending D
    requests have no cap), and the admission window is the whole buffer; a remote list holds
    `min(N, kv_blocks)` entries (each reserves a block); the transfer table holds `N`."""
    n = int(num_requests)
    profiles = list(prefill_profiles) + list(decode_profiles)
    qb = max(int(p.queue_cap) for p in profiles) + n
    seqs = max(int(p.max_seqs) for p in profiles)
    xs = max(1, min(n, max(int(p.kv_blocks) for p in decode_profiles)))
    return (qb, seqs, xs, max(1, n), qb + seqs)


def _replay(prof, is_prefill, link, gap, prompt, output, p_route, d_route, sizes):
    return replay_arrays(prof, is_prefill, link, gap, prompt, output, p_route, d_route, sizes)


_replay_jit = jax.jit(_replay, static_argnames=("sizes",))


def simulate_disagg(arrival, prompt, output, prefill_profiles, decode_profiles, prefill_route,
                    decode_route, link: dict | None = None, sizes: tuple | None = None) -> dict:
    """Simulates disaggregated serving of the requests (the engine's replay of
    `jaxserve/reference/disaggregation.py`'s `simulate` with array routes).

    Args:
      arrival, prompt, output: per-request arrays: arrival (s, non-decreasing), prompt and
        output tokens (each in `[1, types.MAX_TOKENS]`).
      prefill_profiles, decode_profiles: lists of `ReplicaProfile`; the P pool may be empty
        (then every `prefill_route` entry must be -1). Each pool shares `moe_tokens`.
      prefill_route: per request, its P replica, or -1 for not disaggregated.
      decode_route: per request, its D replica.
      link: dict with `bandwidth` (bytes/s), `base_latency` (s), `kv_bytes_per_token`,
        `shared` (bool); missing keys take `disaggregation.LINK_DEFAULTS`.
      sizes: the static sizes (`replay_sizes`' tuple), each at least `replay_sizes`' (to
        share one compilation among replays); None: `replay_sizes`'.

    Returns:
      dict of numpy arrays, per request: `p_replica` (-1 if not disaggregated), `d_replica`,
      `prefill_done`, `transfer_start`, `transfer_end`, `first_token`, `finish` (s, NaN where
      they did not happen), `preemptions` (P and D), `dropped`, `never_fit`; per pool:
      `prefill_iterations`, `decode_iterations`, `prefill_busy`, `decode_busy` (s),
      `prefill_preemptions`, `decode_preemptions`.

    Raises:
      ValueError: invalid arrays, routes, profiles or link.
    """
    arrival = np.asarray(arrival, np.float64)
    prompt = np.asarray(prompt)
    output = np.asarray(output)
    n = arrival.shape[0]
    if arrival.ndim != 1 or n < 1 or prompt.shape != (n,) or output.shape != (n,):
        raise ValueError(f"arrival, prompt, output must be 1-d arrays of one length >= 1, got "
                         f"{arrival.shape}, {prompt.shape}, {output.shape}")
    if not np.all(np.isfinite(arrival)) or np.any(np.diff(arrival) < 0):
        raise ValueError("arrival must be finite and non-decreasing")
    for name, v in (("prompt", prompt), ("output", output)):
        if not np.issubdtype(v.dtype, np.integer) or v.min() < 1 or v.max() > MAX_TOKENS:
            raise ValueError(f"{name} must be integers in [1, {MAX_TOKENS}]")
    pp = _profiles(prefill_profiles, "prefill_profiles")
    dp = _profiles(decode_profiles, "decode_profiles")
    if not dp:
        raise ValueError("decode_profiles must name at least one replica")
    p_route = np.asarray(prefill_route)
    d_route = np.asarray(decode_route)
    if p_route.shape != (n,) or d_route.shape != (n,):
        raise ValueError("prefill_route and decode_route must have one entry per request")
    if not (np.issubdtype(p_route.dtype, np.integer) and np.issubdtype(d_route.dtype, np.integer)):
        raise ValueError("routes must be integer arrays")
    if np.any(p_route < -1) or np.any(p_route >= len(pp)):
        raise ValueError(f"prefill_route entries must be -1 or in [0, {len(pp)})")
    if np.any(d_route < 0) or np.any(d_route >= len(dp)):
        raise ValueError(f"decode_route entries must be in [0, {len(dp)})")
    lk = dict(PD.LINK_DEFAULTS)
    lk.update(link or {})
    unknown = set(lk) - set(PD.LINK_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown link keys {sorted(unknown)}")
    lnk = PD.make_link(**lk)
    need = replay_sizes(pp, dp, n)
    if sizes is None:
        sizes = need
    elif len(sizes) != len(need) or any(int(g) < int(w) for g, w in zip(sizes, need)):
        raise ValueError(f"sizes must be {len(need)} integers each >= {need}, got {sizes}")
    prof = PD.pool_profile(pp, dp)
    is_prefill = jnp.arange(len(pp) + len(dp)) < len(pp)
    gap = np.append(np.diff(arrival), np.inf)
    out = _replay_jit(prof, is_prefill, lnk, jnp.asarray(gap, jnp.float32), jnp.asarray(prompt),
                      jnp.asarray(output), jnp.asarray(p_route), jnp.asarray(d_route),
                      sizes=tuple(int(v) for v in sizes))
    return result_dict(out, arrival, p_route, d_route, num_prefill=len(pp))


def result_dict(out: dict, arrival, p_route, d_route, num_prefill: int) -> dict:
    """`replay_arrays`' output as `simulate_disagg`'s numpy dict: absolute times (float64
    arrival plus each float32 span). Raises RuntimeError if a static size overflowed."""
    if int(out["overflow"]) != 0:
        raise RuntimeError(f"the replay overflowed a static size {int(out['overflow'])} times")
    arrival = np.asarray(arrival, np.float64)
    res = {"p_replica": np.where(np.asarray(p_route) >= 0, p_route, -1).astype(np.int64),
           "d_replica": np.asarray(d_route, np.int64)}
    for k in ("prefill_done", "transfer_start", "transfer_end", "first_token", "finish"):
        res[k] = arrival + np.asarray(out[k], np.float64)
    res["preemptions"] = np.asarray(out["preemptions"], np.int64)
    res["dropped"] = np.asarray(out["dropped"], bool)
    res["never_fit"] = np.asarray(out["never_fit"], bool)
    rep = out["pool"]
    for pool, rows in (("prefill", slice(0, num_prefill)), ("decode", slice(num_prefill, None))):
        res[f"{pool}_iterations"] = np.asarray(rep.iterations, np.int64)[rows]
        res[f"{pool}_busy"] = np.asarray(rep.busy, np.float64)[rows]
        res[f"{pool}_preemptions"] = np.asarray(rep.preemptions, np.int64)[rows]
    return res
