"""The paged KV cache's block pool under automatic prefix caching (docs/prefix_caching.md):
physical blocks with reference counts, identities and an LRU free queue, per replica
(`PrefixCache`), and the operations the scheduler and the prefix cache both build on: which
blocks are free (`free_blocks`), the free queue's order (`free_order`), taking blocks from its
front (`take`), releasing a finished or preempted slot's blocks (`release`) and giving blocks
their identities once full (`cache_full`).

Without prefix caching the engine keeps no pool: a running request holds `ceil(C / b)` blocks
(`C` its computed tokens), so the KV state is a function of the running slots
(`replica_state.kv_used`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


I32_MAX = jnp.iinfo(jnp.int32).max


QUADRATIC_ORDER_MAX = 1024  # blocks up to which `free_order` compares all pairs


@struct.dataclass
class PrefixCache:
    """Physical KV blocks and their identities, per replica (leading axis `R`).

    `M` (the last axis of the block arrays) is the cluster's largest `kv_blocks`; block `x`
    of replica `r` exists when `x < kv_blocks[r]`. A block is *held* (`ref >= 1`), *cached
    unreferenced* (`ref = 0`, identified) or *fresh* (`ref = 0`, no identity); the free queue
    is every existing block with `ref = 0`, ordered by `stamp` (smallest = head).

    Attributes:
      ref: `(R, M)` running requests holding the block. int32.
      cached: `(R, M)` whether the block carries an identity. bool.
      owner, code: `(R, M)` its identity: `(-1, node * per + offset)` for a shared block
        (node of the prefix tree, offset of the KV block inside the hash block, `per =
        block_tokens / block_size`), `(req_id, j)` for block `j` of request `req_id`'s
        private part. int32.
      born: `(R, M)` insertion counter when the identity was set: a lookup takes the
        smallest among copies of one identity (vLLM's first inserted). int32.
      stamp: `(R, M)` free-queue key of unreferenced blocks. int32.
      head_ctr, tail_ctr, born_ctr: `(R,)` next stamps at the head (decreasing) and the
        tail (increasing), next insertion counter. int32.
      s_blocks: `(R, S, M)` physical block of each running slot's KV block `j`. int32.
      s_nblk, s_ncached: `(R, S)` blocks the slot holds, and how many of them (leading)
        carry its identities. int32.
      s_node, s_nshared: `(R, S)` the slot's request: deepest tree node (-1: none) and
        number of shared full KV blocks. int32.
      q_node, q_nshared: `(R, W)` the same for every waiting-queue slot. int32.
      hit_tokens, evictions, shared_preemptions: `(R,)` episode counters: cached tokens over
        admissions, identified blocks popped for reuse, victims holding a block another
        running request holds. int32.
      lookup_tokens, lookup_blocks, hit_blocks: `(R,)` episode counters over admissions:
        tokens `L` of the admitted requests, their full blocks `floor(L / b)`, and the
        blocks found cached (`H`); hit rates are `hit_tokens / lookup_tokens` and
        `hit_blocks / lookup_blocks`. int32.

    Counters (`stamp`, `born`) grow by one per block freed or cached, so an episode may
    free or cache up to 2^31 blocks per replica before they wrap.
    """

    ref: jax.Array
    cached: jax.Array
    owner: jax.Array
    code: jax.Array
    born: jax.Array
    stamp: jax.Array
    head_ctr: jax.Array
    tail_ctr: jax.Array
    born_ctr: jax.Array
    s_blocks: jax.Array
    s_nblk: jax.Array
    s_ncached: jax.Array
    s_node: jax.Array
    s_nshared: jax.Array
    q_node: jax.Array
    q_nshared: jax.Array
    hit_tokens: jax.Array
    evictions: jax.Array
    shared_preemptions: jax.Array
    lookup_tokens: jax.Array
    lookup_blocks: jax.Array
    hit_blocks: jax.Array


def empty_prefix_cache(num_replicas: int, max_seqs: int, queue_slots: int,
                       blocks: int) -> PrefixCache:
    """All `blocks` blocks fresh, in the free queue in index order; nothing running."""
    r, s, w, m = int(num_replicas), int(max_seqs), int(queue_slots), int(blocks)
    if m < 1:
        raise ValueError(f"prefix_blocks must be >= 1, got {m}")
    zm = jnp.zeros((r, m), jnp.int32)
    zs, zr = jnp.zeros((r, s), jnp.int32), jnp.zeros((r,), jnp.int32)
    return PrefixCache(
        ref=zm, cached=jnp.zeros((r, m), jnp.bool_), owner=zm, code=zm, born=zm,
        stamp=jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (r, m)),
        head_ctr=zr - 1, tail_ctr=zr + m, born_ctr=zr,
        s_blocks=jnp.zeros((r, s, m), jnp.int32), s_nblk=zs, s_ncached=zs,
        s_node=zs - 1, s_nshared=zs, q_node=jnp.full((r, w), -1, jnp.int32),
        q_nshared=jnp.zeros((r, w), jnp.int32), hit_tokens=zr, evictions=zr,
        shared_preemptions=zr, lookup_tokens=zr, lookup_blocks=zr, hit_blocks=zr)


def free_blocks(pc, exists):
    return ((pc.ref == 0) & exists).sum()


def free_order(pc: PrefixCache, exists) -> tuple[jax.Array, jax.Array]:
    """One replica's free queue, head first: the existing blocks with `ref = 0` by `stamp`
    (the rest after them, by index). Returns `(order, rank)`: `order[r]` the block of rank
    `r`, `rank[x]` the rank of block `x`; `(M,)` int32 each. Up to `QUADRATIC_ORDER_MAX`
    blocks computed as `jnp.argsort`'s stable order would be, from `O(M^2)` vector
    comparisons: XLA:CPU's sort is a scalar comparator loop, several times slower at the `M`
    of a few hundred the environments use; past it (a real GPU's thousands of 16-token
    blocks, e.g. `evaluation.fidelity`'s replays) the comparisons cost more than the sort
    (2,588 blocks: 12.4 ms against 0.43 ms a call, one replica on the 2-core CPU). Both give
    the same order."""
    m = pc.ref.shape[-1]
    key = jnp.where((pc.ref == 0) & exists, pc.stamp, I32_MAX)
    idx = jnp.arange(m, dtype=jnp.int32)
    if m > QUADRATIC_ORDER_MAX:
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
        return order, jnp.zeros((m,), jnp.int32).at[order].set(idx)
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None])
                                               & (idx[None, :] < idx[:, None]))
    rank = before.sum(-1).astype(jnp.int32)
    return jnp.zeros((m,), jnp.int32).at[rank].set(idx), rank


def release(pc: PrefixCache, slot) -> PrefixCache:
    """Frees slot `slot`'s blocks (rule 6): every `ref - 1`; of the blocks reaching 0, fresh
    ones go to the free queue's head and cached ones to its tail, both tail block first."""
    m = pc.ref.shape[-1]
    j = jnp.arange(m, dtype=jnp.int32)
    on = j < pc.s_nblk[slot]
    x = jnp.where(on, pc.s_blocks[slot], m)
    ref = pc.ref.at[x].add(-1, mode="drop")
    xc = jnp.minimum(x, m - 1)
    freed = on & (ref[xc] == 0)
    fresh, kept = freed & ~pc.cached[xc], freed & pc.cached[xc]
    cf, ck = jnp.cumsum(fresh), jnp.cumsum(kept)
    nf, nk = cf[-1], ck[-1]
    st = jnp.where(fresh, pc.head_ctr + 1 - cf, pc.tail_ctr + nk - ck)
    return pc.replace(ref=ref, stamp=pc.stamp.at[jnp.where(freed, x, m)].set(st, mode="drop"),
                      head_ctr=pc.head_ctr - nf, tail_ctr=pc.tail_ctr + nk,
                      s_nblk=pc.s_nblk.at[slot].set(0), s_ncached=pc.s_ncached.at[slot].set(0))


def take(pc: PrefixCache, exists, slot, n) -> PrefixCache:
    """Gives slot `slot` `n` blocks from the free queue's head (rule 5), appended after its
    `s_nblk` blocks; an identified block popped loses its identity (an eviction)."""
    m = pc.ref.shape[-1]
    order, _ = free_order(pc, exists)
    j = jnp.arange(m, dtype=jnp.int32)
    nb = pc.s_nblk[slot]
    on = (j >= nb) & (j < nb + n)
    picked = order[jnp.clip(j - nb, 0, m - 1)]
    x = jnp.where(on, picked, m)
    evicted = (on & pc.cached[picked]).sum()
    return pc.replace(
        ref=pc.ref.at[x].set(1, mode="drop"), cached=pc.cached.at[x].set(False, mode="drop"),
        s_blocks=pc.s_blocks.at[slot].set(jnp.where(on, picked, pc.s_blocks[slot])),
        s_nblk=pc.s_nblk.at[slot].add(n), evictions=pc.evictions + evicted)


def cache_full(pc: PrefixCache, slot, full, owner, code) -> PrefixCache:
    """Gives slot `slot`'s blocks `[s_ncached, full)` their identities (rule 2: cached when
    the tokens that fill them are scheduled)."""
    m = pc.ref.shape[-1]
    j = jnp.arange(m, dtype=jnp.int32)
    nc = pc.s_ncached[slot]
    row = pc.s_blocks[slot]
    on = (j >= nc) & (j < full) & ~pc.cached[row]
    x = jnp.where(on, row, m)
    put = lambda a, v: a.at[x].set(v, mode="drop")  # noqa: E731
    return pc.replace(cached=put(pc.cached, True), owner=put(pc.owner, owner),
                      code=put(pc.code, code), born=put(pc.born, pc.born_ctr + j - nc),
                      born_ctr=pc.born_ctr + jnp.maximum(full - nc, 0),
                      s_ncached=pc.s_ncached.at[slot].set(jnp.maximum(nc, full)))
