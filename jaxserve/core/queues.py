"""Fixed-capacity per-GPU FIFO queues: ring buffers with a head index and a count.

All arrays have shape `(num_gpus, capacity)`; slot `j` of GPU `g` holds the queue's element at
position `(j - head[g]) mod capacity`, valid when that position is `< count[g]`. Times are
seconds relative to the simulator's current clock origin (see `cluster.rebase`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Request:
    """One request as the engine carries it (scalars, or arrays of them).

    Attributes:
      arrival: arrival time (s, relative clock). float32.
      prompt: prompt tokens. float32 (integer-valued).
      output: true output tokens, hidden from policies. float32.
      estimate: output-length estimate a scheduler may see (tokens). float32.
      size_class: size class of the output length. int32.
      req_id: index of the request in its episode or trace. int32.
    """

    arrival: jax.Array
    prompt: jax.Array
    output: jax.Array
    estimate: jax.Array
    size_class: jax.Array
    req_id: jax.Array


@struct.dataclass
class Queues:
    """Waiting requests of every GPU; fields as in `Request`, each `(num_gpus, capacity)`.

    The size class is not stored: features derive it from the estimate, which is all a
    scheduler knows anyway.
    """

    arrival: jax.Array
    prompt: jax.Array
    output: jax.Array
    estimate: jax.Array
    req_id: jax.Array | None  # None unless a request log is kept (saves state bandwidth)
    head: jax.Array  # (num_gpus,) int32: slot of the first waiting request
    count: jax.Array  # (num_gpus,) int32: requests waiting
    # Running totals over the waiting requests, kept so features never scan the buffers:
    work: jax.Array  # (num_gpus,) float32: summed work shares (s), see cluster.queued_work
    estimate_sum: jax.Array  # (num_gpus,) float32: summed output estimates (tokens)

    @property
    def capacity(self) -> int:
        return self.arrival.shape[-1]


def empty_queues(num_gpus: int, capacity: int, with_ids: bool = True) -> Queues:
    """Empty queues with `capacity` slots per GPU; `with_ids` keeps each request's id."""
    f = jnp.zeros((num_gpus, capacity), jnp.float32)
    i = jnp.zeros((num_gpus, capacity), jnp.int32) if with_ids else None
    z = jnp.zeros((num_gpus,), jnp.int32)
    zf = jnp.zeros((num_gpus,), jnp.float32)
    return Queues(arrival=f, prompt=f, output=f, estimate=f, req_id=i, head=z, count=z,
                  work=zf, estimate_sum=zf)


def positions(q: Queues) -> jax.Array:
    """Queue position of every slot, `(num_gpus, capacity)` int32 (0 = head)."""
    slots = jnp.arange(q.capacity, dtype=jnp.int32)
    return (slots[None, :] - q.head[:, None]) % q.capacity


def waiting_mask(q: Queues) -> jax.Array:
    """True for slots that hold a waiting request, `(num_gpus, capacity)`."""
    return positions(q) < q.count[:, None]


def arrival_at(q: Queues, n: jax.Array) -> jax.Array:
    """Arrival time of the request at position `n[g]` of each GPU's queue, `(num_gpus,)`.

    Meaningful only where `n[g] < count[g]`.
    """
    slot = (q.head + n) % q.capacity
    return jnp.take_along_axis(q.arrival, slot[:, None], axis=1)[:, 0]


def push(q: Queues, gpu: jax.Array, req: Request, limit: jax.Array, work: jax.Array):
    """Appends `req` to the back of GPU `gpu`'s queue unless it already holds `limit[gpu]`.

    `work` is the request's work share on that GPU (s), added to the queue's running total.

    Returns:
      (queues, accepted bool scalar). A refused request leaves the queues unchanged.
    """
    cap = jnp.minimum(limit[gpu], q.capacity)
    accepted = q.count[gpu] < cap
    slot = (q.head[gpu] + q.count[gpu]) % q.capacity

    def put(arr, value):
        return arr.at[gpu, slot].set(jnp.where(accepted, value, arr[gpu, slot]))

    q = q.replace(
        arrival=put(q.arrival, req.arrival), prompt=put(q.prompt, req.prompt),
        output=put(q.output, req.output), estimate=put(q.estimate, req.estimate),
        req_id=None if q.req_id is None else put(q.req_id, req.req_id),
        count=q.count.at[gpu].add(accepted.astype(jnp.int32)),
        work=q.work.at[gpu].add(jnp.where(accepted, work, 0.0)),
        estimate_sum=q.estimate_sum.at[gpu].add(jnp.where(accepted, req.estimate, 0.0)))
    return q, accepted


def front(q: Queues, width: int) -> tuple[jax.Array, Queues]:
    """The first `width` slots of every queue in queue order, `(num_gpus, width)` each.

    Returns (valid mask, a `Queues` whose arrays are those slots). Reading a window instead of
    the whole buffer keeps dispatch cost at O(max_batch), not O(capacity).
    """
    offs = jnp.arange(width, dtype=jnp.int32)
    slots = (q.head[:, None] + offs[None, :]) % q.capacity
    take = lambda a: jnp.take_along_axis(a, slots, axis=1)  # noqa: E731
    win = q.replace(arrival=take(q.arrival), prompt=take(q.prompt), output=take(q.output),
                    estimate=take(q.estimate),
                    req_id=None if q.req_id is None else take(q.req_id))
    return offs[None, :] < q.count[:, None], win


def pop_front(q: Queues, k: jax.Array, work: jax.Array, estimate: jax.Array) -> Queues:
    """Removes the first `k[g]` requests of each GPU's queue (`k <= count`).

    `work` and `estimate` are the removed requests' summed work shares and output estimates;
    the running totals are set to exactly 0 when a queue empties, so round-off cannot build up.
    """
    count = q.count - k
    empty = count == 0
    return q.replace(head=(q.head + k) % q.capacity, count=count,
                     work=jnp.where(empty, 0.0, q.work - work),
                     estimate_sum=jnp.where(empty, 0.0, q.estimate_sum - estimate))
