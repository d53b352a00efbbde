"""Automatic prefix caching in the engine (docs/prefix_caching.md; the design in its "JAX
representation" section): prefix trees as flat tables (`PrefixTables`), block identities, the
admission lookup of the longest cached prefix (`lookup`, `cached_prefix_blocks`), the
scheduler's prefix-aware running pass and admission (`prefix_decide`), what a skipped decode
run may take from the free queue and which blocks it fills (`run_head_check`, `run_blocks`),
the pool's audit and accounting, and the per-step counters (`PREFIX_EXTRAS`).

The block pool itself and its free queue are `kv_blocks`; this module decides which blocks a
request reuses, takes and fills.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.core.cpu_numerics import cdiv, cumsum
from jaxserve.core.kv_blocks import (I32_MAX, PrefixCache, cache_full, free_blocks, free_order,
                                     release, take)
from jaxserve.core.replica import ReplicaProfile
from jaxserve.core.replica_state import Replicas, watermark_blocks


@struct.dataclass
class PrefixTables:
    """The trace's prefix tree as the engine reads it (a param: constant over an episode).

    Attributes:
      parent: `(num_nodes,)` parent node of each tree node, -1 under the root. int32.
      depth: `(num_nodes,)` hash blocks from the root to the node (>= 1). int32.
      block_tokens: tokens per hash block of the tree (Mooncake: 512); every replica's
        `block_size` divides it. Static.
      up: `(levels, num_nodes)` the `2^k`-th ancestor of each node (-1 above the root),
        `levels = max(1, bit_length(max_depth - 1))`: any ancestor in `levels` gathers
        (`ancestor`), where a parent walk takes up to `max_depth` (247 on Mooncake's
        conversation trace). int32.
      max_depth: the tree's largest depth (or more, padding). Static.
    """

    parent: jax.Array
    depth: jax.Array
    up: jax.Array
    block_tokens: int = struct.field(pytree_node=False, default=16)
    max_depth: int = struct.field(pytree_node=False, default=1)


def prefix_tables(parent, depth, block_tokens: int, num_nodes: int | None = None,
                  max_depth: int | None = None) -> PrefixTables:
    """`PrefixTables` from a tree's host arrays (e.g. `traces.prefix.PrefixTree`'s `parent`
    and `depth`); raises ValueError naming the field unless `parent[k] < k` and the depths
    are consistent. `num_nodes` and `max_depth` (at least the tree's) pad the tables with
    unused root nodes and raise the walk's bound, so trees of different sizes share one
    compiled program. An empty tree gets one dummy node (no request refers to it)."""
    parent = np.asarray(parent, np.int64).reshape(-1)
    depth = np.asarray(depth, np.int64).reshape(-1)
    if parent.shape != depth.shape:
        raise ValueError(f"parent and depth must have one entry per node, got {parent.shape} "
                         f"and {depth.shape}")
    k = np.arange(parent.shape[0])
    if np.any((parent < -1) | (parent >= k)):
        raise ValueError("parent must satisfy -1 <= parent[k] < k")
    want = np.where(parent >= 0, depth[np.maximum(parent, 0)] + 1, 1) if len(k) else depth
    if np.any(depth != want):
        raise ValueError("depth must be 1 under the root and parent's depth + 1 below it")
    if int(block_tokens) < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    size = max(parent.shape[0], 1) if num_nodes is None else int(num_nodes)
    if size < max(parent.shape[0], 1):
        raise ValueError(f"num_nodes ({size}) must be >= the tree's nodes ({parent.shape[0]})")
    deepest = int(depth.max()) if depth.size else 1
    max_depth = deepest if max_depth is None else int(max_depth)
    if max_depth < deepest:
        raise ValueError(f"max_depth ({max_depth}) must be >= the tree's depth ({deepest})")
    pad = size - parent.shape[0]
    parent = np.concatenate([parent, np.full(pad, -1, np.int64)])
    depth = np.concatenate([depth, np.ones(pad, np.int64)])
    up = [parent]
    for _ in range(max(1, (max_depth - 1).bit_length()) - 1):
        prev = up[-1]
        up.append(np.where(prev >= 0, prev[np.maximum(prev, 0)], -1))
    return PrefixTables(parent=jnp.asarray(parent, jnp.int32),
                        depth=jnp.asarray(depth, jnp.int32), up=jnp.asarray(np.stack(up),
                                                                            jnp.int32),
                        block_tokens=int(block_tokens), max_depth=max_depth)


def ancestor(tables: PrefixTables, node, depth) -> jax.Array:
    """The ancestor of tree node `node` at depth `depth` (`1 <= depth <= depth(node)`; the
    node itself at its own depth), by binary lifting over `tables.up`: `levels` gathers.
    -1 for `node = -1`. Elementwise over broadcast `node` and `depth`. int32."""
    node = jnp.asarray(node, jnp.int32)
    at = jnp.maximum(node, 0)
    steps = tables.depth[at] - jnp.asarray(depth, jnp.int32)
    for k in range(tables.up.shape[0]):
        at = jnp.where((steps >> k) & 1 == 1, jnp.maximum(tables.up[k][at], 0), at)
    return jnp.where(node >= 0, at, -1)


def shared_blocks(tables: PrefixTables, node, prompt, block_size) -> jax.Array:
    """Full KV blocks of a prompt that lie on its tree path: `min(floor(p / b), depth(node)
    * block_tokens / b)` (0 for `node = -1`), docs/prefix_caching.md section 9. int32."""
    node = jnp.asarray(node, jnp.int32)
    depth = jnp.where(node >= 0, tables.depth[jnp.maximum(node, 0)], 0)
    b = jnp.asarray(block_size, jnp.int32)
    p = jnp.asarray(prompt).astype(jnp.int32)
    return jnp.minimum(p // b, depth * (tables.block_tokens // b))


def block_code(tables: PrefixTables, node, j, b, shared):
    """The `code` of KV block `j` of a request with deepest tree node `node` (see
    `PrefixCache`): a shared block lies in the hash block of the path's node at depth
    `j // per + 1` (`ancestor`), `node * per + j % per`; a private one is `j`.
    Elementwise. int32."""
    per = tables.block_tokens // b
    node = jnp.asarray(node, jnp.int32)
    deep = tables.depth[jnp.maximum(node, 0)]
    return jnp.where(shared, ancestor(tables, node, jnp.clip(j // per + 1, 1, deep)) * per
                     + j % per, j)


def identities(tables: PrefixTables, node, nshared, req_id, b, width: int):
    """Identities `(owner, code)` of a request's KV blocks `0..width-1` (see `PrefixCache`)."""
    j = jnp.arange(width, dtype=jnp.int32)
    shared = j < nshared
    return jnp.where(shared, -1, req_id), block_code(tables, node, j, b, shared)


def lookup(pc: PrefixCache, tables: PrefixTables, node, nshared, req_id, b, cap):
    """Longest cached prefix of a request's blocks (rule 3), at most `cap` blocks: `(H, the
    first inserted cached copy of each block j < H)` (0 where block j has no copy).

    The request: its deepest tree node `node`, `nshared` shared full KV blocks, `req_id`
    (the owner of its private blocks). Computed per pool block, not per pair of request
    block and pool block: a cached shared block `(-1, n per + o)` is the request's block
    `(depth(n) - 1) per + o` when `n` lies on the request's path and that block is shared
    (`< nshared`); a private block `(req_id, j)` is its block `j >= nshared`. The first
    inserted copy of block `j` is then a scatter-min of `born` at `j` (ties, which the
    counters never make, to the lowest index). O(M)."""
    m = pc.ref.shape[-1]
    per = tables.block_tokens // b
    shared = pc.owner == -1
    blk = jnp.clip(jnp.where(shared, pc.code // per, 0), 0, tables.parent.shape[0] - 1)
    d = tables.depth[blk]
    j_sh = (d - 1) * per + pc.code % per
    node = jnp.asarray(node, jnp.int32)
    deep = jnp.where(node >= 0, tables.depth[jnp.maximum(node, 0)], 0)
    on_path = (d <= deep) & (ancestor(tables, node, jnp.clip(d, 1, jnp.maximum(deep, 1)))
                             == blk)
    pos = jnp.where(shared, jnp.where(on_path & (j_sh < nshared), j_sh, m),
                    jnp.where((pc.owner == req_id) & (pc.code >= nshared), pc.code, m))
    pos = jnp.where(pc.cached & (pos >= 0) & (pos < m), pos, m)
    born_min = jnp.full((m,), I32_MAX, jnp.int32).at[pos].min(pc.born, mode="drop")
    oldest = jnp.where(pc.born == born_min[jnp.minimum(pos, m - 1)], pos, m)
    first = jnp.full((m,), m, jnp.int32).at[oldest].min(jnp.arange(m, dtype=jnp.int32),
                                                        mode="drop")
    j = jnp.arange(m, dtype=jnp.int32)
    hit = (first < m) & (j < cap)
    h = jnp.argmin(jnp.concatenate([hit, jnp.zeros((1,), jnp.bool_)])).astype(jnp.int32)
    return h, jnp.where(first < m, first, 0)


def cached_prefix_blocks(rep: Replicas, prof: ReplicaProfile, tables: PrefixTables, node,
                         prompt) -> jax.Array:
    """Per replica, the leading shared KV blocks of a prompt with deepest tree node `node`
    that the replica's cache holds now (referenced or not): the longest run `H` of the
    prompt's shared full blocks (`shared_blocks`) found cached, as a router reads it from the
    replicas' KV events (llm-d's precise prefix scorer, Dynamo's KV router). It is the
    admission lookup (rule 3) without the `floor((L - 1) / b)` cap, which only matters for a
    prompt whose every block is shared. Reads the cache only. `(R,)` int32 blocks (times
    `block_size` for tokens)."""
    node = jnp.asarray(node, jnp.int32)

    def one(pc, b):
        nsh = shared_blocks(tables, node, prompt, b)
        return lookup(pc, tables, node, nsh, jnp.int32(-2), b, nsh)[0]

    return jax.vmap(one)(rep.pc, prof.block_size).astype(jnp.int32)


def running_pass_fits(pc: PrefixCache, run, prof: ReplicaProfile, tables: PrefixTables,
                       exists, queue=None):
    """The running pass of one replica when no preemption occurs, vectorised.

    With `n_i` the budget taken in admission order and `e_i` the new blocks of slot `i`,
    the sequential pass is never short when `sum e_i <= free` (before slot `i` the free
    queue still holds `free - sum_{j<i} e_j >= e_i`). Then slot `i` takes the free queue's
    blocks of ranks `[sum_{j<i} e_j, sum_{j<=i} e_j)` (caching held blocks does not change
    the queue), and the slots' newly full blocks are cached in slot-major order (the order
    of `born` among copies of one identity). `queue`: the pool's free queue
    (`free_order`) if the caller has it, else computed here.

    Returns (whether it applies, the pool after the pass, `n` per slot).
    """
    s_n = run.arrival.shape[-1]
    m = pc.ref.shape[-1]
    b = prof.block_size
    idx = jnp.arange(s_n, dtype=jnp.int32)
    valid = idx < run.count
    rem = jnp.where(valid, run.prompt + run.gen - run.comp, 0)
    n = jnp.clip(prof.max_tokens - (jnp.cumsum(rem) - rem), 0, rem)
    extra = jnp.where(n > 0, cdiv(run.comp + n, b) - pc.s_nblk, 0)
    ends = jnp.cumsum(extra)
    total = ends[-1]
    fits = total <= free_blocks(pc, exists)
    order, rank_of = free_order(pc, exists) if queue is None else queue
    # Both the blocks taken and the blocks newly full are enumerated as items `k < M`
    # (slot-major), each finding its slot among the `S` running ones, so the pass writes
    # O(M) entries instead of working on `(S, M)` block tables.
    k = jnp.arange(m, dtype=jnp.int32)
    slot_of = lambda ends: jnp.minimum(  # noqa: E731 (the slot of item k: ends[s-1] <= k < ends[s])
        (ends[None, :] <= k[:, None]).sum(-1).astype(jnp.int32), s_n - 1)
    st = slot_of(ends)
    j_take = pc.s_nblk[st] + k - (ends[st] - extra[st])
    blocks = pc.s_blocks.at[jnp.where(k < total, st, s_n), j_take].set(order, mode="drop")
    # The blocks taken are the free queue's first `total`: marked by their rank in it.
    taken = (pc.ref == 0) & exists & (rank_of < total)
    pc = pc.replace(ref=jnp.where(taken, 1, pc.ref), cached=pc.cached & ~taken,
                    s_blocks=blocks, s_nblk=pc.s_nblk + extra,
                    evictions=pc.evictions + (taken & pc.cached).sum())
    full = jnp.where(n > 0, (run.comp + n) // b, 0)
    # A slot's blocks past its `s_ncached` are never identified (`prefix_audit` checks it),
    # so its newly full blocks are the run `[s_ncached, full)`; item k (slot-major) gets
    # insertion counter `born_ctr + k`.
    count = jnp.maximum(full - pc.s_ncached, 0)
    ends_new = cumsum(count)
    sn = slot_of(ends_new)
    j_new = pc.s_ncached[sn] + k - (ends_new[sn] - count[sn])
    is_new = k < ends_new[-1]
    x_new = jnp.where(is_new, blocks[sn, jnp.minimum(j_new, m - 1)], m)
    shared = j_new < pc.s_nshared[sn]
    code = block_code(tables, pc.s_node[sn], j_new, b, shared)
    owner = jnp.where(shared, -1, run.req_id[sn])
    # Each newly full block is one item: one scatter of its item number, then gathers.
    src = jnp.full((m,), -1, jnp.int32).at[x_new].set(k, mode="drop")
    hit = src >= 0
    at = lambda a, v: jnp.where(hit, v[jnp.maximum(src, 0)], a)  # noqa: E731
    pc = pc.replace(cached=pc.cached | hit, owner=at(pc.owner, owner),
                    code=at(pc.code, code), born=at(pc.born, pc.born_ctr + k),
                    born_ctr=pc.born_ctr + ends_new[-1],
                    s_ncached=jnp.where(n > 0, jnp.maximum(pc.s_ncached, full), pc.s_ncached))
    return fits, pc, n


def prefix_decide(pc: PrefixCache, run, w, prof: ReplicaProfile, tables: PrefixTables, go,
                   queue=None):
    """One replica's scheduling pass with prefix caching (docs/prefix_caching.md rule 7.3),
    sequential: the running pass (preempting from the back while the free queue is short),
    then, if nothing was preempted, FCFS admission with a cache lookup per head.

    `run`: the replica's `Running` slots; `w`: its first `S` waiting requests (dict of `(S,)`
    arrays `valid, len, node, nshared, req_id`); `queue` its free queue if known (see
    `running_pass_fits`). Returns `(pc, n_run, keep, admit, w_n,
    w_comp)` (see `apply_schedule`) with the admitted requests' blocks in slots
    `keep + m`.
    """
    s_n = run.arrival.shape[-1]
    m = pc.ref.shape[-1]
    b = prof.block_size
    exists = jnp.arange(m) < prof.kv_blocks
    length = run.prompt + run.gen

    def run_cond(c):
        i, cnt, k, pre, stop, _, _ = c
        return go & (i < cnt) & (k > 0) & ~stop

    def run_body(c):
        i, cnt, k, pre, stop, n_run, pc = c
        n = jnp.minimum(length[i] - run.comp[i], k)
        extra = cdiv(run.comp[i] + n, b) - pc.s_nblk[i]
        short = free_blocks(pc, exists) < extra

        def preempt(pc):
            v = cnt - 1
            row = pc.s_blocks[v]
            held = (jnp.arange(m) < pc.s_nblk[v]) & (pc.ref[row] > 1)
            pc = release(pc, v).replace(
                shared_preemptions=pc.shared_preemptions + held.any().astype(jnp.int32))
            return (i, v, k, True, v == i, n_run, pc)

        def schedule(pc):
            owner, code = identities(tables, pc.s_node[i], pc.s_nshared[i], run.req_id[i],
                                      b, m)
            pc = take(pc, exists, i, extra)
            pc = cache_full(pc, i, (run.comp[i] + n) // b, owner, code)
            return (i + 1, cnt, k - n, pre, stop, n_run.at[i].set(n), pc)

        return jax.lax.cond(short, preempt, schedule, pc)

    # When the running requests' new blocks all fit the free queue nothing is preempted and
    # the pass is vectorised (`running_pass_fits`); the loop then runs no trip.
    fits, pc_fit, n_fit = running_pass_fits(pc, run, prof, tables, exists, queue)
    fast = fits & go
    pc = jax.tree.map(lambda a, b: jnp.where(fast, a, b), pc_fit, pc)
    i0 = jnp.where(fast, run.count, 0).astype(jnp.int32)
    k0 = prof.max_tokens - jnp.where(fast, n_fit.sum(), 0)
    _, keep, k, pre, _, n_run, pc = jax.lax.while_loop(
        run_cond, run_body, (i0, run.count, k0, jnp.bool_(False),
                             jnp.bool_(False), jnp.where(fast, n_fit, 0), pc))
    wm = watermark_blocks(prof)
    chunk = prof.chunked_prefill

    def adm_cond(c):
        j, k, stop, _, _, _ = c
        return (go & ~pre & ~stop & (j < s_n) & (keep + j < prof.max_seqs) & (k > 0)
                & w["valid"][jnp.minimum(j, s_n - 1)])

    def adm_body(c):
        j, k, stop, w_n, w_comp, pc = c
        slot = keep + j
        ln = w["len"][j]
        owner, code = identities(tables, w["node"][j], w["nshared"][j], w["req_id"][j], b, m)
        h, first = lookup(pc, tables, w["node"][j], w["nshared"][j], w["req_id"][j], b,
                           (ln - 1) // b)
        c_tok = h * b
        rest = ln - c_tok
        n = jnp.where(chunk, jnp.minimum(rest, k), rest)
        jj = jnp.arange(m, dtype=jnp.int32)
        hits = jj < h
        new = cdiv(c_tok + n, b) - h
        need = new + (hits & (pc.ref[first] == 0)).sum()
        ok = (chunk | (rest <= k)) & (free_blocks(pc, exists) - need >= wm)

        def admit(pc):
            pc = pc.replace(ref=pc.ref.at[jnp.where(hits, first, m)].add(1, mode="drop"),
                            s_blocks=pc.s_blocks.at[slot].set(jnp.where(hits, first, 0)),
                            s_nblk=pc.s_nblk.at[slot].set(h),
                            s_ncached=pc.s_ncached.at[slot].set(h),
                            s_node=pc.s_node.at[slot].set(w["node"][j]),
                            s_nshared=pc.s_nshared.at[slot].set(w["nshared"][j]),
                            hit_tokens=pc.hit_tokens + c_tok,
                            lookup_tokens=pc.lookup_tokens + ln,
                            lookup_blocks=pc.lookup_blocks + ln // b,
                            hit_blocks=pc.hit_blocks + h)
            pc = take(pc, exists, slot, new)
            pc = cache_full(pc, slot, (c_tok + n) // b, owner, code)
            return (j + 1, k - n, stop, w_n.at[j].set(n), w_comp.at[j].set(c_tok), pc)

        return jax.lax.cond(ok, admit, lambda pc: (j, k, True, w_n, w_comp, pc), pc)

    z = jnp.zeros((s_n,), jnp.int32)
    a, _, _, w_n, w_comp, pc = jax.lax.while_loop(
        adm_cond, adm_body, (jnp.int32(0), k, jnp.bool_(False), z, z, pc))
    admit = jnp.arange(s_n) < a
    keep = jnp.where(go, keep, run.count)
    return pc, n_run, keep, admit, w_n, w_comp


def prefix_audit(rep: Replicas, prof: ReplicaProfile) -> jax.Array:
    """Per replica, whether the block pool is consistent (tests; `advance(audit=True)` checks
    it at every boundary): each block's `ref` equals the running slots holding it, no slot
    holds a block twice, a running slot holds `ceil((C + scheduled) / b)` blocks of which
    exactly the leading `s_ncached` are identified, blocks beyond `kv_blocks` are untouched,
    and `fresh + cached_unreferenced + held = kv_blocks`. `(R,)` bool."""
    pc, run = rep.pc, rep.run
    r_n, s_n, m = pc.s_blocks.shape
    j = jnp.arange(m, dtype=jnp.int32)
    valid = jnp.arange(s_n)[None, :] < run.count[:, None]
    on = valid[:, :, None] & (j[None, None, :] < pc.s_nblk[:, :, None])  # (R, S, M)
    x = jnp.where(on, pc.s_blocks, m)
    count = jax.vmap(lambda xs: jnp.zeros((m,), jnp.int32).at[xs.ravel()].add(1, mode="drop"))(x)
    exists = j[None, :] < prof.kv_blocks[:, None]
    dup = ((x[:, :, :, None] == x[:, :, None, :]) & on[:, :, :, None]
           & (j[:, None] != j[None, :])[None, None]).any((-1, -2, -3))
    held_ok = jnp.where(valid, pc.s_nblk == cdiv(run.comp + run.sched,
                                                   prof.block_size[:, None]), True).all(-1)
    xc = jnp.minimum(x, m - 1)
    ident = jnp.take_along_axis(pc.cached, xc.reshape(r_n, -1), -1).reshape(x.shape)
    ident_ok = (~on | (ident == (j[None, None, :] < pc.s_ncached[:, :, None]))).all((-1, -2))
    free = (pc.ref == 0) & exists
    fresh = (free & ~pc.cached).sum(-1)
    unref = (free & pc.cached).sum(-1)
    held = ((pc.ref > 0) & exists).sum(-1)
    return ((count == pc.ref).all(-1) & ~dup & held_ok & ident_ok
            & ~(~exists & ((pc.ref != 0) | pc.cached)).any(-1)
            & (fresh + unref + held == prof.kv_blocks))


def block_accounting(rep: Replicas, prof: ReplicaProfile) -> dict[str, jax.Array]:
    """Per replica `(R,)` int32: `fresh`, `cached_unreferenced` and `held` blocks (they sum to
    `kv_blocks`; docs/prefix_caching.md section 4)."""
    pc = rep.pc
    exists = jnp.arange(pc.ref.shape[-1])[None, :] < prof.kv_blocks[:, None]
    free = (pc.ref == 0) & exists
    return {"fresh": (free & ~pc.cached).sum(-1).astype(jnp.int32),
            "cached_unreferenced": (free & pc.cached).sum(-1).astype(jnp.int32),
            "held": ((pc.ref > 0) & exists).sum(-1).astype(jnp.int32)}


def run_head_check(pc: PrefixCache, prof: ReplicaProfile, tables: PrefixTables, head,
                    count, k1, free1):
    """One replica at a pure-decode boundary, with prefix caching: whether the waiting head
    is admitted after the running pass took its blocks (rule 7.3's admission test of the
    head: lookup, budget, watermark), and how many blocks a decode run may take from the free
    queue without changing that test.

    A run's decode iterations take the free queue's first blocks in order. The head's lookup
    (its cached prefix `H` and the copy `first` of each of its blocks) changes only if a
    taken block is one of its unreferenced hits `first[j]`, `j < H`: taking another copy or
    a block past `H` leaves both, new identities are the running requests' private decode
    blocks, and no block is released before a completion. So while the run takes fewer
    blocks than the free-queue rank of the head's first unreferenced hit, the head needs the
    same blocks and tokens while the free blocks only fall, and its admission keeps failing.

    `head`: `(valid, length L, node, nshared, req_id)` of the waiting head; `k1` the budget
    and `free1` the free blocks left after the running pass. Returns `(admit, the rank cap
    in blocks (int32 max when no hit constrains), the free queue (`free_order`))`.
    """
    valid, ln, node, nshared, req_id = head
    m = pc.ref.shape[-1]
    b = prof.block_size
    exists = jnp.arange(m) < prof.kv_blocks
    h, first = lookup(pc, tables, node, nshared, req_id, b, (ln - 1) // b)
    c_tok = h * b
    rest = ln - c_tok
    chunk = prof.chunked_prefill
    n = jnp.where(chunk, jnp.minimum(rest, k1), rest)
    unref_hit = (jnp.arange(m) < h) & (pc.ref[first] == 0)
    need = cdiv(c_tok + n, b) - h + unref_hit.sum()
    could = valid & (count < prof.max_seqs) & (k1 > 0)
    admit = could & (chunk | (rest <= k1)) & (free1 - need >= watermark_blocks(prof))
    queue = free_order(pc, exists)
    cap = jnp.where(could, jnp.where(unref_hit, queue[1][first], I32_MAX).min(), I32_MAX)
    return admit, cap, queue


# Blocks one slot may take (and fill) in a skipped decode run with prefix caching: the run
# ends before a slot's next one, so `run_blocks` works on `(S, RUN_BLOCKS)` arrays instead
# of the `(S, M)` block table (a run is at most `RUN_BLOCKS * b` iterations, 512 at b = 128).
RUN_BLOCKS = 4


def run_blocks(pc: PrefixCache, queue, comp, valid, req_id, k, b) -> PrefixCache:
    """One replica's block pool after `k` pure-decode iterations of its running slots
    (`valid`, `comp` tokens computed, one token scheduled each per iteration), given that
    every block they take fits the free queue (`queue`: `free_order`'s pair) and
    no slot takes or fills more than `RUN_BLOCKS` blocks.

    Per iteration the running pass gives each slot whose next token starts a block one block
    from the free queue's head, in slot order (rule 5), then caches the blocks its token
    fills (rule 2). Slot `i` takes at iterations `f_i + t b` (`f_i = (-C_i) mod b`) and
    fills its block `C_i // b + t` at iterations `g_i + t b` (`g_i = (-C_i - 1) mod b`). In
    every period of `b` iterations each of the `P` running slots takes (fills) once, in
    order of `(f_i, i)` (`(g_i, i)`), so slot `i`'s `t`-th take is the free queue's block of
    rank `t P + pos_i` and its `t`-th filled block gets insertion counter `born_ctr + t P +
    pos'_i`: the state the per-iteration passes leave, in closed form. Decode blocks lie past
    the prompt's shared blocks, so their identities are the request's private `(req_id, j)`.
    With `k = 0` or no `valid` slot the pool is returned unchanged.
    """
    s_n, m = pc.s_blocks.shape
    jj = jnp.arange(m, dtype=jnp.int32)[None, :]
    slot = jnp.arange(s_n, dtype=jnp.int32)
    p = valid.sum().astype(jnp.int32)  # every running slot decodes

    def position(off):  # rank of each slot among the running ones, by (off, slot)
        before = valid[None, :] & ((off[None, :] < off[:, None])
                                   | ((off[None, :] == off[:, None])
                                      & (slot[None, :] < slot[:, None])))
        return before.sum(-1).astype(jnp.int32)[:, None]

    order, rank_of = queue
    f = (-comp) % b
    takes = jnp.where(valid & (k > f), (k - 1 - f) // b + 1, 0)
    nb = pc.s_nblk[:, None]
    on = (jj >= nb) & (jj < nb + takes[:, None])  # (S, M)
    blocks = jnp.where(on, order[jnp.clip((jj - nb) * p + position(f), 0, m - 1)],
                       pc.s_blocks)
    # The blocks taken are the free queue's first `sum takes`: marked by their rank in it.
    taken = (pc.ref == 0) & (rank_of < takes.sum())
    nc = pc.s_ncached[:, None]
    t = jnp.arange(RUN_BLOCKS, dtype=jnp.int32)[None, :]
    fills = jnp.where(valid, (comp + k) // b - pc.s_ncached, 0)
    new = t < fills[:, None]  # (S, RUN_BLOCKS)
    xs = jnp.where(new, jnp.take_along_axis(blocks, jnp.minimum(nc + t, m - 1), -1), m).ravel()
    born = pc.born_ctr + t * p + position((-comp - 1) % b)
    put = lambda a, v: a.at[xs].set(jnp.broadcast_to(v, new.shape).ravel(),  # noqa: E731
                                    mode="drop")
    return pc.replace(
        ref=jnp.where(taken, 1, pc.ref), cached=put(pc.cached & ~taken, True),
        owner=put(pc.owner, req_id[:, None]), code=put(pc.code, nc + t),
        born=put(pc.born, born), born_ctr=pc.born_ctr + fills.sum(), s_blocks=blocks,
        s_nblk=pc.s_nblk + takes,
        s_ncached=jnp.where(valid, jnp.maximum(pc.s_ncached, nc[:, 0] + fills), pc.s_ncached),
        evictions=pc.evictions + (taken & pc.cached).sum())


PREFIX_EXTRAS = ("prefix_hit_tokens", "prefix_lookup_tokens", "prefix_hit_blocks",
                 "prefix_lookup_blocks", "prefix_evictions", "prefix_shared_preemptions")


def prefix_extras(before: PrefixCache, after: PrefixCache) -> dict[str, jax.Array]:
    """Prefix-cache counters of a window, summed over replicas (int32), reported by `advance`
    next to `zero_extras()` when caching: cached tokens at admissions (= prefill tokens
    saved) and the admitted requests' tokens (token hit rate = their ratio), cached and full
    blocks (block hit rate), evictions, and preemptions of block-sharing requests."""
    d = lambda f: (getattr(after, f) - getattr(before, f)).sum().astype(jnp.int32)  # noqa
    return {"prefix_hit_tokens": d("hit_tokens"), "prefix_lookup_tokens": d("lookup_tokens"),
            "prefix_hit_blocks": d("hit_blocks"), "prefix_lookup_blocks": d("lookup_blocks"),
            "prefix_evictions": d("evictions"),
            "prefix_shared_preemptions": d("shared_preemptions")}
