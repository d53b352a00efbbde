"""The state of the disaggregation engine (`core.disaggregation`, docs/disaggregation.md):
the link (`Link`), each replica's remote list (`RemoteList`), the transfers in flight
(`Transfers`), the per-request routing tables (`PDTables`) and log (`PDLog`), the cluster
(`PDCluster`: both pools as rows of one `Replicas`), and their constructors.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.core.replica import ReplicaProfile, stack_replicas
from jaxserve.core.replica_state import Replicas, TokenLog, empty_log, empty_replicas

# BLIS's defaults (docs/disaggregation.md section 7): 25 GB/s, 0.05 ms, sharing as the page's
# Reading 6 (on); bytes per token 0 until a model is named.
LINK_DEFAULTS = {"bandwidth": 25e9, "base_latency": 0.05e-3, "kv_bytes_per_token": 0.0,
                 "shared": True}


@struct.dataclass
class Link:
    """The KV-transfer link (scalars). `bandwidth` bytes/s, `base_latency` s,
    `kv_bytes_per_token` bytes/token (float32); `shared` (bool): equal shares among the
    transfers in flight, fixed at a transfer's start."""

    bandwidth: jax.Array
    base_latency: jax.Array
    kv_bytes_per_token: jax.Array
    shared: jax.Array


def make_link(bandwidth=LINK_DEFAULTS["bandwidth"], base_latency=LINK_DEFAULTS["base_latency"],
              kv_bytes_per_token=LINK_DEFAULTS["kv_bytes_per_token"],
              shared=LINK_DEFAULTS["shared"]) -> Link:
    """A validated `Link` (host side). Raises ValueError: bandwidth not finite and > 0,
    latency or bytes per token negative or not finite, `shared` not a bool."""
    for name, v, low_ok in (("bandwidth", bandwidth, False), ("base_latency", base_latency, True),
                            ("kv_bytes_per_token", kv_bytes_per_token, True)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                                  np.floating)):
            raise ValueError(f"link {name} must be a number, got {v!r}")
        if not math.isfinite(float(v)) or float(v) < 0 or (not low_ok and float(v) == 0):
            raise ValueError(f"link {name} must be finite and {'>= 0' if low_ok else '> 0'}, "
                             f"got {v!r}")
    if not isinstance(shared, (bool, np.bool_)):
        raise ValueError(f"link shared must be a bool, got {shared!r}")
    return Link(bandwidth=jnp.float32(bandwidth), base_latency=jnp.float32(base_latency),
                kv_bytes_per_token=jnp.float32(kv_bytes_per_token), shared=jnp.bool_(shared))


@struct.dataclass
class RemoteList:
    """Each D replica's remote list (vLLM's `skipped_waiting`): D requests holding reserved
    blocks, receiving (transfer in flight) or ready (ended), in allocation order; `(R_D, X)`
    arrays, entry `x` valid when `x < count`.

    Attributes: `valid`, `ready` (bool); `res` reserved blocks (`ceil(p / b_D)`); `arrival`
    (relative s, the request's arrival); `prompt`, `output` (tokens), `req_id` (int32);
    `count` `(R_D,)`.
    """

    valid: jax.Array
    ready: jax.Array
    res: jax.Array
    arrival: jax.Array
    prompt: jax.Array
    output: jax.Array
    req_id: jax.Array
    count: jax.Array

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in ("valid", "ready", "res", "arrival", "prompt",
                                              "output", "req_id")}


@struct.dataclass
class Transfers:
    """Transfers in flight, a table of `T` entries (`active` marks the used ones).

    Attributes: `end`, `end_lo` (relative s, compensated pair); `arrival` (relative s, the
    request's); `req_id`, `p`, `d` (its P and D replicas), `blocks` (P blocks it moves, freed
    on P at its end). `(T,)` each.
    """

    active: jax.Array
    end: jax.Array
    end_lo: jax.Array
    arrival: jax.Array
    req_id: jax.Array
    p: jax.Array
    d: jax.Array
    blocks: jax.Array


@struct.dataclass
class PDTables:
    """Per-request routing, written at arrival (`(N,)` int32): `src` the P replica (-1: not
    disaggregated), `dest` the D replica, `output` the request's output tokens (the D request
    generates them; the P request only one)."""

    src: jax.Array
    dest: jax.Array
    output: jax.Array


@struct.dataclass
class PDLog:
    """Per-request outcome, spans from the request's arrival (s; NaN until it happens).

    Attributes:
      requests: a `TokenLog` of `2 N` entries: entry `i` is request `i` on D (`ttft` the
        client's first token, D's first sample; `e2e` the finish; `preemptions` on D; a
        request not disaggregated runs only there), entry `N + i` its P request (`ttft` =
        `e2e` = P's sample, `prefill_done`; `preemptions` on P).
      transfer_start, transfer_end: `(N,)` float32.
    """

    requests: TokenLog
    transfer_start: jax.Array
    transfer_end: jax.Array


@struct.dataclass
class PDCluster:
    """The disaggregated cluster: both pools as one `Replicas` of `R = R_P + R_D` rows, P
    replicas first (row `k` is P replica `k`, row `R_P + k` D replica `k`), so that one
    scheduler call and one iteration end serve both (a P row's remote list and pending flags
    stay empty, so its boundary is the colocated one).

    Attributes:
      pool: the replicas.
      is_prefill: `(R,)` bool, the P rows.
      sending: `(R,)` blocks each P replica holds for sends (finished P requests whose
        transfer has not ended). int32.
      remote: the remote lists `(R, X)` (empty on P rows).
      q_pending: `(R, W)` bool over the waiting ring slots: pending D requests (False on
        every slot not holding a waiting request).
      transfers: the link's transfers in flight (`p`, `d`: rows).
      first_res: `(R,)` blocks by which the reservations of the ready requests in the
        iteration in progress exceed their computed tokens' (`ceil(p / b) - ceil((p - 1) /
        b)` each: while `C = p - 1` a request holds `max(ceil(C / b), res)`; after that
        iteration `C = p` and the reservation adds nothing). Only `replica_views` reads it.
        int32.
      now, now_lo: the current instant (relative s, compensated pair).
      overflow: static-size overflows so far (0 in a valid run). int32.
      tables: per-request routing (`src`, `dest`: rows; `src` -1 when not disaggregated).
    """

    pool: Replicas
    is_prefill: jax.Array
    sending: jax.Array
    remote: RemoteList
    q_pending: jax.Array
    transfers: Transfers
    first_res: jax.Array
    now: jax.Array
    now_lo: jax.Array
    overflow: jax.Array
    tables: PDTables


def empty_pd(num_prefill: int, num_decode: int, *, queue_buffer: int, max_seqs: int,
             remote_slots: int, transfer_slots: int, num_requests: int) -> PDCluster:
    """An idle cluster of `num_prefill` (may be 0) P and `num_decode` D replicas.

    Static sizes: `queue_buffer` waiting slots beyond the running ones (`empty_replicas`;
    D's must also hold pending D requests, which no queue cap bounds); `max_seqs` running
    slots (both pools' largest `max_seqs`); `remote_slots` remote entries per replica;
    `transfer_slots` transfers in flight; `num_requests` the per-request tables' length.
    """
    for name, v, low in (("num_prefill", num_prefill, 0), ("num_decode", num_decode, 1),
                         ("queue_buffer", queue_buffer, 1), ("max_seqs", max_seqs, 1),
                         ("remote_slots", remote_slots, 1), ("transfer_slots", transfer_slots, 1),
                         ("num_requests", num_requests, 1)):
        if int(v) < low:
            raise ValueError(f"{name} must be >= {low}, got {v}")
    r = int(num_prefill) + int(num_decode)
    x, t, n = int(remote_slots), int(transfer_slots), int(num_requests)
    pool = empty_replicas(r, queue_buffer, max_seqs, with_ids=True)
    zx = jnp.zeros((r, x), jnp.int32)
    fx = jnp.zeros((r, x), jnp.bool_)
    zt = jnp.zeros((t,), jnp.int32)
    return PDCluster(
        pool=pool, is_prefill=jnp.arange(r) < int(num_prefill),
        sending=jnp.zeros((r,), jnp.int32),
        remote=RemoteList(valid=fx, ready=fx, res=zx, arrival=jnp.zeros((r, x), jnp.float32),
                          prompt=zx, output=zx, req_id=zx, count=jnp.zeros((r,), jnp.int32)),
        q_pending=jnp.zeros(pool.q_gen.shape, jnp.bool_),
        transfers=Transfers(active=jnp.zeros((t,), jnp.bool_), end=jnp.zeros((t,), jnp.float32),
                            end_lo=jnp.zeros((t,), jnp.float32),
                            arrival=jnp.zeros((t,), jnp.float32), req_id=zt, p=zt, d=zt,
                            blocks=zt),
        first_res=jnp.zeros((r,), jnp.int32), now=jnp.float32(0.0), now_lo=jnp.float32(0.0),
        overflow=jnp.int32(0),
        tables=PDTables(src=jnp.full((n,), -1, jnp.int32), dest=jnp.zeros((n,), jnp.int32),
                        output=jnp.zeros((n,), jnp.int32)))


def empty_pd_log(num_requests: int) -> PDLog:
    """A log of `num_requests` requests, nothing happened yet."""
    nan = jnp.full((num_requests,), jnp.nan, jnp.float32)
    return PDLog(requests=empty_log(2 * num_requests), transfer_start=nan, transfer_end=nan)


def pool_profile(prefill: Sequence[ReplicaProfile], decode: Sequence[ReplicaProfile]
                 ) -> ReplicaProfile:
    """The stacked profile of `PDCluster.pool`: P replicas' then D replicas' (host side;
    `stack_replicas` validates them, and both pools must share `moe_tokens`)."""
    return stack_replicas(list(prefill) + list(decode))
