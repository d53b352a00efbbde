"""Fixed-capacity per-GPU FIFO queues: ring buffers with a head index and a count.

All arrays have shape `(num_gpus, capacity)`; slot `j` of GPU `g` holds the queue's element at
position `(j - head[g]) mod capacity`, valid when that position is `< count[g]`. Times are
seconds relative to the simulator's current clock origin (see `cluster.rebase`).

Arrival times are stored against a per-GPU `offset`: the relative arrival of a slot is
`arrival + offset[g]`. Moving the clock origin (`shift`) changes only the offsets, instead of
rewriting every slot of every queue on every step. `push` re-anchors the row it writes to
(adds its offset, sets it to 0), so a row's offset only drifts while nothing is pushed to it,
and then by no more than its waiting requests' own age: float32 keeps the relative arrivals as
precise as before, however long the episode runs.
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

    arrival: jax.Array  # stored arrival; the relative arrival is arrival + offset[:, None]
    prompt: jax.Array
    output: jax.Array
    estimate: jax.Array
    req_id: jax.Array | None  # None unless a request log is kept (saves state bandwidth)
    head: jax.Array  # (num_gpus,) int32: slot of the first waiting request
    count: jax.Array  # (num_gpus,) int32: requests waiting
    # Running totals over the waiting requests, kept so features never scan the buffers:
    work: jax.Array  # (num_gpus,) float32: summed work shares (s), see cluster.queued_work
    estimate_sum: jax.Array  # (num_gpus,) float32: summed output estimates (tokens)
    offset: jax.Array  # (num_gpus,) float32: time base of the stored arrivals (s)

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
                  work=zf, estimate_sum=zf, offset=zf)


def positions(q: Queues) -> jax.Array:
    """Queue position of every slot, `(num_gpus, capacity)` int32 (0 = head)."""
    slots = jnp.arange(q.capacity, dtype=jnp.int32)
    return (slots[None, :] - q.head[:, None]) % q.capacity


def waiting_mask(q: Queues) -> jax.Array:
    """True for slots that hold a waiting request, `(num_gpus, capacity)`."""
    return positions(q) < q.count[:, None]


def arrival_times(q: Queues) -> jax.Array:
    """Relative arrival time of every slot (s), `(num_gpus, capacity)`; see `waiting_mask`."""
    return q.arrival + q.offset[:, None]


def stored_arrival_at(q: Queues, n: jax.Array) -> jax.Array:
    """Stored arrival (before adding `offset`) at position `n[g]` of each GPU's queue.

    `(num_gpus,)`; meaningful only where `n[g] < count[g]`.
    """
    slot = (q.head + n) % q.capacity
    return jnp.take_along_axis(q.arrival, slot[:, None], axis=1)[:, 0]


def arrival_at(q: Queues, n: jax.Array) -> jax.Array:
    """Arrival time of the request at position `n[g]` of each GPU's queue, `(num_gpus,)`.

    Meaningful only where `n[g] < count[g]`.
    """
    return stored_arrival_at(q, n) + q.offset


def push(q: Queues, gpu: jax.Array, req: Request, limit: jax.Array, work: jax.Array,
         enabled: jax.Array | bool = True):
    """Appends `req` to the back of GPU `gpu`'s queue unless it already holds `limit[gpu]`.

    `work` is the request's work share on that GPU (s), added to the queue's running total.
    Re-anchors the GPU's stored arrivals (see the module docstring). Slots are written without
    being read first, a refused request's write being dropped, so XLA can update the buffers
    in place. Where `enabled` is False nothing is written at all (every write is dropped): a
    masked loop body can push unconditionally and keep the slot buffers it returns, instead
    of selecting between two copies of them (`lanes.compacted_while`'s `gated` bodies).

    Returns:
      (queues, accepted bool scalar). A refused request leaves the queue unchanged.
    """
    cap = jnp.minimum(limit[gpu], q.capacity)
    accepted = (q.count[gpu] < cap) & enabled
    slot = jnp.where(accepted, (q.head[gpu] + q.count[gpu]) % q.capacity, q.capacity)
    row_at = jnp.where(enabled, gpu, q.head.shape[0])  # the GPU's row, or none (dropped)

    def put(arr, value):
        return arr.at[gpu, slot].set(value, mode="drop")

    # The re-anchored row with the new arrival, written back as one row: under `vmap` that
    # is one scatter; a row add then a slot write (two) measured ~80 ns per env-step more.
    row = (q.arrival[gpu] + q.offset[gpu]).at[slot].set(req.arrival, mode="drop")
    q = q.replace(
        arrival=q.arrival.at[row_at].set(row, mode="drop"), prompt=put(q.prompt, req.prompt),
        output=put(q.output, req.output), estimate=put(q.estimate, req.estimate),
        req_id=None if q.req_id is None else put(q.req_id, req.req_id),
        count=q.count.at[gpu].add(accepted.astype(jnp.int32)),
        work=q.work.at[gpu].add(jnp.where(accepted, work, 0.0)),
        estimate_sum=q.estimate_sum.at[gpu].add(jnp.where(accepted, req.estimate, 0.0)),
        offset=q.offset.at[row_at].set(0.0, mode="drop"))
    return q, accepted


SLOT_FIELDS = ("arrival", "prompt", "output", "estimate", "req_id")


def with_slots(q: Queues, source: Queues) -> Queues:
    """`q` with its slot buffers (`SLOT_FIELDS`) taken from `source`, the rest kept."""
    return q.replace(**{f: getattr(source, f) for f in SLOT_FIELDS})


def front(q: Queues, width: int) -> tuple[jax.Array, Queues]:
    """The first `width` slots of every queue in queue order, `(num_gpus, width)` each.

    Returns (valid mask, a `Queues` whose arrays are those slots). Reading a window instead of
    the whole buffer keeps dispatch cost at O(max_batch), not O(capacity).
    """
    offs = jnp.arange(width, dtype=jnp.int32)
    slots = (q.head[:, None] + offs[None, :]) % q.capacity
    take = lambda a: jnp.take_along_axis(a, slots, axis=1)  # noqa: E731
    win = q.replace(arrival=take(q.arrival) + q.offset[:, None], prompt=take(q.prompt),
                    output=take(q.output),
                    estimate=take(q.estimate),
                    req_id=None if q.req_id is None else take(q.req_id))
    return offs[None, :] < q.count[:, None], win


def pop_heads(head, count, work, estimate_sum, k, popped_work, popped_estimate, capacity: int):
    """`pop_front` on the per-queue scalars alone (any shape), for callers holding only those.

    Returns (head, count, work, estimate_sum) after removing `k` requests whose summed work
    shares and output estimates are `popped_work` and `popped_estimate`; the running totals are
    set to exactly 0 when a queue empties, so round-off cannot build up.
    """
    count = count - k
    empty = count == 0
    return ((head + k) % capacity, count, jnp.where(empty, 0.0, work - popped_work),
            jnp.where(empty, 0.0, estimate_sum - popped_estimate))


def pop_front(q: Queues, k: jax.Array, work: jax.Array, estimate: jax.Array) -> Queues:
    """Removes the first `k[g]` requests of each GPU's queue (`k <= count`).

    `work` and `estimate` are the removed requests' summed work shares and output estimates.
    """
    head, count, w, e = pop_heads(q.head, q.count, q.work, q.estimate_sum, k, work, estimate,
                                  q.capacity)
    return q.replace(head=head, count=count, work=w, estimate_sum=e)


def shift(q: Queues, dt: jax.Array) -> Queues:
    """Moves the clock origin `dt` seconds forward (every relative arrival minus `dt`).

    Touches only the `(num_gpus,)` offsets, not the slot buffers.
    """
    return q.replace(offset=q.offset - dt)
