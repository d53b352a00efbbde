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
    """Waiting requests of every GPU; fields as in `Request`, each `(num_gpus, capacity)`."""

    arrival: jax.Array
    prompt: jax.Array
    output: jax.Array
    estimate: jax.Array
    size_class: jax.Array
    req_id: jax.Array
    head: jax.Array  # (num_gpus,) int32: slot of the first waiting request
    count: jax.Array  # (num_gpus,) int32: requests waiting

    @property
    def capacity(self) -> int:
        return self.arrival.shape[-1]


def empty_queues(num_gpus: int, capacity: int) -> Queues:
    """Empty queues with `capacity` slots per GPU."""
    f = jnp.zeros((num_gpus, capacity), jnp.float32)
    i = jnp.zeros((num_gpus, capacity), jnp.int32)
    z = jnp.zeros((num_gpus,), jnp.int32)
    return Queues(arrival=f, prompt=f, output=f, estimate=f, size_class=i, req_id=i,
                  head=z, count=z)


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


def push(q: Queues, gpu: jax.Array, req: Request, limit: jax.Array):
    """Appends `req` to the back of GPU `gpu`'s queue unless it already holds `limit[gpu]`.

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
        size_class=put(q.size_class, req.size_class), req_id=put(q.req_id, req.req_id),
        count=q.count.at[gpu].add(accepted.astype(jnp.int32)))
    return q, accepted


def pop_front(q: Queues, k: jax.Array) -> Queues:
    """Removes the first `k[g]` requests of each GPU's queue (`k <= count`)."""
    return q.replace(head=(q.head + k) % q.capacity, count=q.count - k)
