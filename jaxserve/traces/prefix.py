"""Prefix identity of requests: a prefix tree of hash blocks, in static-shape arrays.

Traces with prefix structure (Mooncake's `hash_ids`, the synthetic shared-prefix generator) name
each prompt's blocks of `block_tokens` tokens by ids, equal ids meaning equal content. They are
stored as the trace's **prefix tree** (one node per distinct prefix of the id lists; node =
`(parent node, id)`, so equal ids under different parents are different nodes, as with vLLM's
chained block hashes) with per-node arrays `parent`, `depth`, `hash_id`, and per request its
deepest node and its number of full blocks: nothing of per-request length is stored, and a
request's path is recovered by following `parent`. The semantics are docs/prefix_caching.md's.
"""

from __future__ import annotations

import numpy as np
from flax import struct

from jaxserve.core.types import Trace, numeric_array, validate_trace

__all__ = ["PrefixTree", "PrefixTrace", "build_prefix_tree", "validate_prefix_trace",
           "path_nodes", "reused_blocks", "infinite_cache_reuse", "kv_prefix", "prefix_window"]


@struct.dataclass
class PrefixTree:
    """Nodes of a trace's prefix tree of hash blocks (host numpy arrays, `(num_nodes,)`).

    Attributes:
      parent: parent node id, -1 for a node directly under the root; `parent[k] < k`.
      depth: number of hash blocks on the path from the root to the node (>= 1).
      hash_id: the trace's id of the node's own block.
      block_tokens: tokens per hash block (512 for Mooncake); not a pytree leaf.
    """

    parent: np.ndarray
    depth: np.ndarray
    hash_id: np.ndarray
    block_tokens: int = struct.field(pytree_node=False, default=512)

    @property
    def num_nodes(self) -> int:
        return int(np.shape(self.parent)[0])


@struct.dataclass
class PrefixTrace:
    """A request trace plus each request's place in a prefix tree of hash blocks.

    Attributes:
      trace: arrivals (s), prompt and output tokens.
      node: `(n,)` deepest tree node of each request's id list (-1 when empty).
      full_blocks: `(n,)` hash blocks of the prompt that are full, `prompt //
        block_tokens` (the path's first `full_blocks` nodes; the deepest node is partial when
        `full_blocks < depth[node]`, and full blocks past the path's end are the request's
        own, shared with no one: a path names at most `ceil(prompt / block_tokens)` blocks).
      tree: the prefix tree.
    """

    trace: Trace
    node: np.ndarray
    full_blocks: np.ndarray
    tree: PrefixTree

    def __len__(self) -> int:
        return len(self.trace)


def _int_column(value, where: str, n: int | None = None) -> np.ndarray:
    """`value` as a 1-D int64 array (of `n` entries when given), else ValueError naming
    `where`. Only integer dtypes pass: a float node id would otherwise be truncated."""
    a = numeric_array(value, where)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{where} must hold integers, got dtype {a.dtype}")
    if a.ndim != 1 or (n is not None and a.shape[0] != n):
        want = "1-D" if n is None else f"({n},) (one entry per request)"
        raise ValueError(f"{where} must be {want}, got shape {a.shape}")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{where} holds values past int64")
    return a.astype(np.int64)


def validate_prefix_trace(pt: PrefixTrace) -> PrefixTrace:
    """Checks a `PrefixTrace` on the host; returns it with int64 / float64 numpy arrays.

    Raises ValueError naming the field for: an invalid or empty trace (`validate_trace`);
    `node`, `full_blocks` or the tree's `parent`, `depth`, `hash_id` not integer arrays
    (float ids would be truncated) or of the wrong length; a tree that is not one
    (`parent[k]` in `[-1, k)`, `depth` 1 under the root and the parent's + 1 below);
    `block_tokens` not an integer >= 1; a `node` outside `[-1, num_nodes)` or deeper than its
    prompt's blocks (`depth[node] <= ceil(prompt / block_tokens)`); `full_blocks` other than
    `prompt // block_tokens` (the field's definition; the path may be shorter, its remaining
    full blocks private, as for a request at -1).
    """
    if not isinstance(pt, PrefixTrace):
        raise ValueError(f"trace must be a PrefixTrace, got {type(pt).__name__}")
    tree = pt.tree
    if not isinstance(tree, PrefixTree):
        raise ValueError(f"PrefixTrace.tree must be a PrefixTree, got {type(tree).__name__}")
    if isinstance(pt.trace, Trace) and np.ndim(pt.trace.arrival_s) == 1 and len(pt.trace) == 0:
        raise ValueError("PrefixTrace.trace holds no requests (an empty trace)")
    trace = validate_trace(pt.trace)
    n = len(trace)
    bt = tree.block_tokens
    if isinstance(bt, (bool, np.bool_)) or not isinstance(bt, (int, np.integer)) or bt < 1:
        raise ValueError(f"PrefixTree.block_tokens must be an integer >= 1, got {bt!r}")
    parent = _int_column(tree.parent, "PrefixTree.parent")
    k = parent.shape[0]
    depth = _int_column(tree.depth, "PrefixTree.depth", k)
    hash_id = _int_column(tree.hash_id, "PrefixTree.hash_id", k)
    idx = np.arange(k)
    if np.any((parent < -1) | (parent >= idx)):
        bad = int(np.flatnonzero((parent < -1) | (parent >= idx))[0])
        raise ValueError(f"PrefixTree.parent[{bad}] must be in [-1, {bad}), got {parent[bad]}")
    want = np.where(parent >= 0, depth[np.maximum(parent, 0)] + 1, 1)
    if np.any(depth != want):
        bad = int(np.flatnonzero(depth != want)[0])
        raise ValueError(f"PrefixTree.depth[{bad}] must be {want[bad]} (1 under the root, the "
                         f"parent's depth + 1 below it), got {depth[bad]}")
    node = _int_column(pt.node, "PrefixTrace.node", n)
    if np.any((node < -1) | (node >= k)):
        bad = int(np.flatnonzero((node < -1) | (node >= k))[0])
        raise ValueError(f"PrefixTrace.node[{bad}] must be -1 or a tree node in [0, {k}), got "
                         f"{node[bad]}")
    path = np.where(node >= 0, depth[np.maximum(node, 0)] if k else 0, 0)
    blocks = -(-trace.prompt_tokens // int(bt))
    if np.any(path > blocks):
        bad = int(np.flatnonzero(path > blocks)[0])
        raise ValueError(f"PrefixTrace.node[{bad}] ({node[bad]}) is at depth {path[bad]}, but "
                         f"its prompt has only ceil({trace.prompt_tokens[bad]} / block_tokens "
                         f"{int(bt)}) = {blocks[bad]} blocks")
    full = _int_column(pt.full_blocks, "PrefixTrace.full_blocks", n)
    if np.any(full < 0):
        bad = int(np.flatnonzero(full < 0)[0])
        raise ValueError(f"PrefixTrace.full_blocks[{bad}] must be >= 0, got {full[bad]}")
    expect = trace.prompt_tokens // int(bt)
    if np.any(full != expect):
        bad = int(np.flatnonzero(full != expect)[0])
        raise ValueError(f"PrefixTrace.full_blocks[{bad}] must be prompt_tokens // block_tokens "
                         f"= {trace.prompt_tokens[bad]} // {int(bt)} = {expect[bad]}, got "
                         f"{full[bad]}")
    return PrefixTrace(trace=trace, node=node, full_blocks=full,
                       tree=PrefixTree(parent=parent, depth=depth, hash_id=hash_id,
                                       block_tokens=int(bt)))


def build_prefix_tree(hash_lists, block_tokens: int) -> tuple[PrefixTree, np.ndarray]:
    """Builds the prefix tree of hash-id lists given in arrival order.

    A node is a distinct `(parent node, id)` pair (chained identity), numbered in order of first
    appearance, so `parent[k] < k`. Returns the tree and each list's deepest node (-1 if empty).
    """
    nodes: dict = {}
    parent, depth, hash_id = [], [], []
    node = np.full(len(hash_lists), -1, np.int64)
    for row, ids in enumerate(hash_lists):
        cur = -1
        for d, h in enumerate(ids):
            key = (cur, h)
            nxt = nodes.get(key)
            if nxt is None:
                nxt = nodes[key] = len(parent)
                parent.append(cur)
                depth.append(d + 1)
                hash_id.append(h)
            cur = nxt
        node[row] = cur
    tree = PrefixTree(parent=np.asarray(parent, np.int64), depth=np.asarray(depth, np.int64),
                      hash_id=np.asarray(hash_id, np.int64), block_tokens=int(block_tokens))
    return tree, node


def path_nodes(tree: PrefixTree, node: int) -> list[int]:
    """The nodes from the root's child down to `node` (empty for -1), following `parent`."""
    out = []
    while node >= 0:
        out.append(int(node))
        node = int(tree.parent[node])
    return out[::-1]


def reused_blocks(mt: PrefixTrace) -> np.ndarray:
    """Per request (arrival order), the blocks of the longest prefix of its list already seen
    in earlier requests: `(n,)` int64.

    A node is first created by the earliest request whose path contains it, and a path's nodes
    are created in order, so the reused prefix of request `i` is the part of its path made of
    nodes first created by requests before `i`."""
    first = np.full(mt.tree.num_nodes, -1, np.int64)
    out = np.zeros(len(mt), np.int64)
    for i in range(len(mt)):
        for k in path_nodes(mt.tree, int(mt.node[i])):
            if first[k] < 0:
                first[k] = i
            if first[k] < i:
                out[i] += 1
    return out


def infinite_cache_reuse(mt: PrefixTrace) -> float:
    """Share of all hash blocks that lie in the longest prefix of a request's list already seen
    in earlier requests (`reused_blocks` over all blocks): the traces README's "prefix-block
    reuse, infinite cache" (one cache shared by all replicas that never evicts; an upper bound
    for any real cache)."""
    depth = np.where(mt.node >= 0, mt.tree.depth[np.maximum(mt.node, 0)], 0)
    total = int(depth.sum())
    return float(reused_blocks(mt).sum() / total) if total else 0.0


def kv_prefix(mt: PrefixTrace, i: int, block_size: int) -> list[tuple[int, int]]:
    """Request `i`'s KV-block identities at vLLM's `block_size` (docs/prefix_caching.md, 9).

    KV block `j` (tokens `[j b, (j + 1) b)`) lying inside the prompt gets the id `(node of
    hash block q = floor(j b / T), j - q T / b)`, `T` the hash block size: blocks inside equal
    hash blocks are equal. Returns the ids of the `floor(prompt / b)` full KV blocks (the form
    `jaxserve.reference.prefix.simulate_prefix` takes as `prefix[i]`).

    Raises ValueError unless `block_size` divides the hash block size.
    """
    T = mt.tree.block_tokens
    if block_size < 1 or T % block_size:
        raise ValueError(f"block_size must divide the trace's {T}-token hash blocks, got "
                         f"{block_size}")
    per = T // block_size
    path = path_nodes(mt.tree, int(mt.node[i]))
    n_full = int(mt.trace.prompt_tokens[i]) // block_size
    return [(path[j // per], j % per) for j in range(n_full)]


def prefix_window(mt: PrefixTrace, start: int, stop: int,
                  time_scale: float = 1.0) -> PrefixTrace:
    """Requests `[start, stop)` of `mt` as a trace of their own: arrivals rebased so that the
    first is at 0 s and multiplied by `time_scale` (> 1 stretches time: the arrival rate is
    divided by it), and the prefix tree rebuilt from only their paths (`build_prefix_tree` over
    the paths' `hash_id`s: nodes numbered by first appearance in the window, so equal prefixes
    stay shared and nothing of other requests is kept).

    Raises ValueError for an empty or out-of-range window or a `time_scale` that is not
    finite and > 0.
    """
    n = len(mt)
    start, stop = int(start), int(stop)
    if not 0 <= start < stop <= n:
        raise ValueError(f"window [{start}, {stop}) must be a non-empty range of the trace's "
                         f"{n} requests")
    scale = float(time_scale)
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"time_scale must be finite and > 0, got {time_scale}")
    lists = [[int(mt.tree.hash_id[k]) for k in path_nodes(mt.tree, int(mt.node[i]))]
             for i in range(start, stop)]
    tree, node = build_prefix_tree(lists, mt.tree.block_tokens)
    a = np.asarray(mt.trace.arrival_s[start:stop], np.float64)
    trace = Trace(arrival_s=(a - a[0]) * scale,
                  prompt_tokens=np.asarray(mt.trace.prompt_tokens[start:stop]),
                  output_tokens=np.asarray(mt.trace.output_tokens[start:stop]))
    return PrefixTrace(trace=trace, node=node,
                       full_blocks=np.asarray(mt.full_blocks[start:stop]), tree=tree)
