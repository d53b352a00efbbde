"""Event-by-event reference of continuous batching with automatic prefix caching.

Plain Python, float64, written from `docs/prefix_caching.md` (vLLM v1's rules), not from any
JAX code. It extends `jaxserve/reference/continuous.py` (the `MODEL_CONTINUOUS.md` reference) by
subclassing its request and replica and reusing its event loop, iteration-time formula and drop
rules; what changes is the KV memory:

* `M` physical blocks, each with a reference count and at most one identity (a node of the
  prefix tree). A request holds a list of physical blocks; its first `ncached` have identities.
* Identity of KV block `j` of request `i` (docs rule 1): the node of the path
  `prefix_i[0..j]` when `j < len(prefix_i)` (shared, chained), else a private node `(i, j)`.
  Requests carry their prefix as a *list of block ids* (the reference's choice: the simplest
  form to write by hand; traces store tree nodes instead, see `jaxserve/traces/mooncake.py`).
* Free queue (rule 6): an ordered dict of the blocks with `ref = 0`, head first. Freeing a
  request walks its blocks in reverse; blocks reaching `ref = 0` go to the head if they have no
  identity, to the tail if they do. Allocation pops from the head and evicts what it pops.
* Admission (rules 3-5): lookup of the longest cached chain, capped at `floor((L - 1) / b)`
  blocks; need = new blocks + unreferenced hit blocks; stop if `free - need < floor(w M)`;
  touch the hits, take new blocks, cache the blocks full after `C + n`.
* Running pass: new blocks `ceil((C + n) / b) - held`, preempting from the back while the free
  queue is shorter; blocks full after `C + n` are cached at scheduling (rule 2).
* Finished requests free their blocks at the iteration's end, in scheduling order.

With `caching=False` nothing is looked up or cached, and the model is `MODEL_CONTINUOUS.md`.

Outside the contract, for measurements only (`evaluation.fidelity`): a profile dict may set
`reserve_full: True` to admit a head only when the blocks of its whole sequence are free (vLLM
0.19's `scheduler_reserve_full_isl`), and `simulate_prefix` takes a `step_time` replacing the
iteration-time formula (e.g. one read from kernel profiles).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from jaxserve.reference.continuous import REPLICA_KEYS, _Replica, _Req, simulate

__all__ = ["REPLICA_KEYS", "PrefixTree", "simulate_prefix"]


class PrefixTree:
    """Interns block identities: shared nodes `(parent, id)` and private nodes `(i, j)`."""

    def __init__(self):
        self.nodes: dict = {}

    def node(self, key) -> int:
        n = self.nodes.get(key)
        if n is None:
            n = self.nodes[key] = len(self.nodes)
        return n


class _PReq(_Req):
    __slots__ = ("prefix", "tree", "keys", "blocks", "ncached", "cached")

    def __init__(self, i, a, p, o, prefix, tree):
        super().__init__(i, a, p, o)
        self.prefix = list(prefix)
        self.tree = tree
        self.keys = []  # identity node of KV block j, built on demand
        self.blocks = []  # physical blocks held, in block order
        self.ncached = 0  # leading blocks of `blocks` that carry an identity
        self.cached = []  # cached tokens at each admission

    def key(self, j):
        """Identity node of this request's KV block `j` (docs rule 1)."""
        while len(self.keys) <= j:
            jj = len(self.keys)
            if jj < len(self.prefix):
                parent = self.keys[-1] if jj else -1
                self.keys.append(self.tree.node(("s", parent, self.prefix[jj])))
            else:
                self.keys.append(self.tree.node(("p", self.i, jj)))
        return self.keys[j]


class _PReplica(_Replica):
    def __init__(self, prof, caching=True, audit=None, step_time=None, on_iteration=None,
                 accounting=True):
        super().__init__(prof, step_time, on_iteration)
        self.track = accounting
        self.reserve_full = bool(prof.get("reserve_full", False))
        self.caching = caching
        self.audit = audit
        self.ref = [0] * self.M
        self.ident = [None] * self.M
        self.queue = OrderedDict((x, None) for x in range(self.M))  # free queue, head first
        self.cache = {}  # node -> {block: None}, insertion order = lookup order
        self.evictions = 0
        self.shared_preemptions = 0  # victims holding a block another running request holds
        self.hit_tokens = 0
        self.accounting = []  # (t, fresh, cached_unreferenced, held) after every change

    # ---- block pool (docs rules 2, 5, 6) -------------------------------------------------
    def _lookup(self, r):
        if not self.caching:
            return []
        hits = []
        for j in range((r.L - 1) // self.b):
            copies = self.cache.get(r.key(j))
            if not copies:
                break
            hits.append(next(iter(copies)))
        return hits

    def _take(self, n):
        out = []
        for _ in range(n):
            x, _ = self.queue.popitem(last=False)
            node = self.ident[x]
            if node is not None:
                copies = self.cache[node]
                del copies[x]
                if not copies:
                    del self.cache[node]
                self.ident[x] = None
                self.evictions += 1
            self.ref[x] = 1
            out.append(x)
        return out

    def _touch(self, blocks):
        for x in blocks:
            if self.ref[x] == 0:
                del self.queue[x]
            self.ref[x] += 1

    def _cache_full(self, r, tokens):
        if not self.caching:
            return
        full = tokens // self.b
        for j in range(r.ncached, full):
            x = r.blocks[j]
            if self.ident[x] is None:
                node = r.key(j)
                self.ident[x] = node
                self.cache.setdefault(node, {})[x] = None
        r.ncached = max(r.ncached, full)

    def _free(self, r):
        order = list(reversed(r.blocks))
        for x in order:
            self.ref[x] -= 1
        freed = [x for x in order if self.ref[x] == 0]
        fresh = [x for x in freed if self.ident[x] is None]
        for x in reversed(fresh):
            self.queue[x] = None
            self.queue.move_to_end(x, last=False)
        for x in freed:
            if self.ident[x] is not None:
                self.queue[x] = None
        r.blocks = []
        r.ncached = 0

    def _record(self, t):
        if not self.track:  # counting fresh blocks is O(M) per change: skippable for large M
            if self.audit is not None:
                self.audit(self)
            return
        fresh = sum(1 for x in self.queue if self.ident[x] is None)
        unref = len(self.queue) - fresh
        self.accounting.append((t, fresh, unref, self.M - len(self.queue)))
        if self.audit is not None:
            self.audit(self)

    # ---- scheduler (docs rule 7) ---------------------------------------------------------
    def schedule(self, t):
        k = self.K
        sched = []
        preempted = False
        i = 0
        while i < len(self.running) and k > 0:
            r = self.running[i]
            n = min(r.L - r.C, k)
            extra = self.blocks(r.C + n) - len(r.blocks)
            self_victim = False
            while len(self.queue) < extra:
                v = self.running.pop()
                self.shared_preemptions += any(self.ref[x] > 1 for x in v.blocks)
                self._free(v)
                self.requeue_preempted(v)
                preempted = True
                if v is r:
                    self_victim = True
                    break
            if self_victim:
                break
            r.blocks += self._take(extra)
            self._cache_full(r, r.C + n)
            sched.append((r, n))
            k -= n
            i += 1
        if not preempted:
            while len(self.running) < self.S and k > 0 and self.waiting:
                h = self.waiting[0]
                hits = self._lookup(h)
                c = len(hits) * self.b
                rest = h.L - c
                if self.chunked:
                    n = min(rest, k)
                elif rest > k:
                    break
                else:
                    n = rest
                new = self.blocks(c + n) - len(hits)
                need = new + sum(1 for x in hits if self.ref[x] == 0)
                # vLLM 0.19's `scheduler_reserve_full_isl`: admit only when the whole sequence's
                # blocks are free, not just the chunk's (an option, not the contract's rule).
                full = need - new + self.blocks(h.L) - len(hits) if self.reserve_full else need
                if len(self.queue) - max(need, full) < self.wm:
                    break
                self.waiting.popleft()
                self.running.append(h)
                self._touch(hits)
                h.blocks = hits + self._take(new)
                h.ncached = len(hits)
                h.C = c
                self._cache_full(h, c + n)
                h.cached.append(c)
                self.hit_tokens += c
                sched.append((h, n))
                k -= n
        if not sched:
            self.stalled = True
            self._record(t)
            return
        T = self.iteration_time(sched)
        if self.on_iteration is not None:
            self.on_iteration(self, t, sched, T)
        self.scheduled = sched
        self.end = t + T
        self.iterations += 1
        held = self.M - len(self.queue)
        self.busy += T
        self.kv_block_s += held * T
        self.kv_peak = max(self.kv_peak, held)
        self._record(t)

    def finish_iteration(self, t):
        for r, n in self.scheduled:
            r.C += n
            if r.C == r.L:
                r.g += 1
                if r.first is None:
                    r.first = t
                if r.g == r.o:
                    r.finish = t
        for r, _ in self.scheduled:
            if r.finish is not None:
                self._free(r)
        self.running = [r for r in self.running if r.finish is None]
        self.scheduled = []
        self.end = None
        self._record(t)


def audit_replica(rp):
    """Raises AssertionError unless the replica's block pool is consistent (tests call this
    after every change): reference counts equal the running requests holding each block, the
    free queue is exactly the unreferenced blocks, the hash map is exactly the identified
    blocks, a running request holds `ceil(C / b)` blocks (after its scheduled tokens), its
    identified blocks carry its own identities, and `fresh + cached_unreferenced + held = M`."""
    ref = [0] * rp.M
    n_of = {id(q): n for q, n in rp.scheduled}
    for r in rp.running:
        assert len(r.blocks) == rp.blocks(r.C + n_of.get(id(r), 0)), (r.i, len(r.blocks), r.C)
        assert len(set(r.blocks)) == len(r.blocks)
        for j, x in enumerate(r.blocks):
            ref[x] += 1
            if j < r.ncached:
                assert rp.ident[x] == r.key(j), (r.i, j)
    for r in rp.waiting:
        assert not r.blocks and r.C == 0
    assert ref == rp.ref, "reference counts differ from the running requests' blocks"
    assert set(rp.queue) == {x for x in range(rp.M) if ref[x] == 0}
    mapped = {x for copies in rp.cache.values() for x in copies}
    assert mapped == {x for x in range(rp.M) if rp.ident[x] is not None}
    for node, copies in rp.cache.items():
        assert copies and all(rp.ident[x] == node for x in copies)
    _, fresh, unref, held = rp.accounting[-1]
    assert fresh + unref + held == rp.M
    assert held == sum(1 for x in range(rp.M) if ref[x] > 0)


def simulate_prefix(arrival, prompt, output, replica, profiles, prefix, caching=True,
                    audit=False, check=None, step_time=None, on_iteration=None,
                    accounting=True, router=None, lockstep_idle_s=None):
    """Simulates the routed requests on replicas with prefix caching (docs/prefix_caching.md).

    Args:
      arrival, prompt, output, replica: per-request arrays (arrivals non-decreasing; seconds,
        tokens, tokens, replica index).
      profiles: list of dicts with `REPLICA_KEYS` (as `jaxserve/reference/continuous.py`).
      prefix: per request, a list of block ids naming its first full prompt blocks (block `j`
        is shared with every request whose list agrees on entries `0..j`); `len(prefix[i]) *
        block_size <= prompt[i]` is required (ValueError otherwise).
      caching: False disables lookup and caching (then this is `MODEL_CONTINUOUS.md`).
      audit: check the block pool's invariants (`audit_replica`) after every change.
      check, step_time, on_iteration, router, lockstep_idle_s: as in `continuous.simulate`.
      accounting: False skips the per-change block accounting (O(M) each; `accounting` is
        then empty).

    Returns:
      `continuous.simulate`'s dict (`first_token`, `finish`, `dropped`, `never_fit`,
      `preemptions`, per-replica `iterations`, `replica_preemptions`, `busy` (s), `kv_block_s`
      (distinct held blocks integrated over iterations), `kv_peak`) plus `cached_tokens` (per
      request, the list of cached tokens at each admission), per replica `hit_tokens`,
      `evictions`, `shared_preemptions` (victims that held a block shared with another running
      request), and `accounting` (per replica, `(t, fresh, cached_unreferenced, held)`
      after every scheduling step and iteration end).
    """
    tree = PrefixTree()
    reqs, reps = [], []
    for i in range(len(arrival)):
        b = int(profiles[int(replica[i])]["block_size"])
        if len(prefix[i]) * b > int(prompt[i]):
            raise ValueError(f"prefix[{i}] names {len(prefix[i])} blocks of {b} tokens but the "
                             f"prompt has {int(prompt[i])} tokens")

    def make_request(i, a, p, o):
        r = _PReq(i, a, p, o, prefix[i], tree)
        reqs.append(r)
        return r

    def make_replica(k, prof):
        rp = _PReplica(prof, caching=caching, audit=audit_replica if audit else None,
                       step_time=step_time, on_iteration=on_iteration, accounting=accounting)
        reps.append(rp)
        return rp

    out = simulate(arrival, prompt, output, replica, profiles, check=check,
                   make_request=make_request, make_replica=make_replica, router=router,
                   lockstep_idle_s=lockstep_idle_s)
    out["cached_tokens"] = [list(r.cached) for r in reqs]
    out["hit_tokens"] = np.array([rp.hit_tokens for rp in reps], np.int64)
    out["evictions"] = np.array([rp.evictions for rp in reps], np.int64)
    out["shared_preemptions"] = np.array([rp.shared_preemptions for rp in reps], np.int64)
    out["accounting"] = [list(rp.accounting) for rp in reps]
    return out


def random_shared_workload(rng, n, *, b, systems=3, branch=3, max_depth=4, rate=1.0,
                           tail=(1, 8), output=(1, 12), dyadic=True):
    """Random requests sharing prefixes (tests): each request picks a system prompt (Zipf-like
    popularity), then walks a random path of `0..max_depth` more shared blocks among `branch`
    children per node, then adds `tail` private prompt tokens. Arrivals are Poisson with
    `rate` req/s, rounded up to a 1/4 s grid when `dyadic` (exact float sums).

    Returns (arrival, prompt, output, prefix) with prefix lists of block ids."""
    gaps = rng.exponential(1.0 / rate, n)
    arrival = np.cumsum(gaps)
    if dyadic:
        arrival = np.ceil(arrival * 4) / 4
    pop = 1.0 / np.arange(1, systems + 1)
    pop /= pop.sum()
    prompt = np.zeros(n, np.int64)
    out = rng.integers(output[0], output[1] + 1, n)
    prefix = []
    for i in range(n):
        s = int(rng.choice(systems, p=pop))
        path = [("sys", s)]
        for d in range(int(rng.integers(0, max_depth + 1))):
            path.append(("c", d, int(rng.integers(0, branch))))
        prefix.append(path)
        prompt[i] = len(path) * b + int(rng.integers(tail[0], tail[1] + 1))
    return arrival, prompt, out, prefix
