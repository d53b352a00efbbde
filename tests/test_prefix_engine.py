"""The continuous engine with automatic prefix caching (`core/continuous.py`, `Replicas.pc`)
against the event-by-event reference `jaxserve/reference/prefix.py` (docs/prefix_caching.md).

Dyadic workloads (arrivals on a 1/4 s grid, coefficients powers of two, 4-token blocks) make
every time exact in float32 and float64, so the engine must equal the reference *exactly* per
request: first token, finish, drop, preemptions and cached tokens at admission, and per
replica the hit tokens, evictions, preemptions of block-sharing requests, iterations and the
final block accounting. Every case runs with the engine's block-pool audit on (reference
counts rebuilt from the running requests' block tables and `fresh + cached_unreferenced +
held = kv_blocks` at every boundary). All cases are padded to one trace length and one set of
static sizes so they share a compiled program.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.core import continuous as CB
from jaxserve.core import kv_blocks as KB
from jaxserve.core import prefix_cache as PC
from jaxserve.core import queues as Q
from jaxserve.core.replica import ReplicaProfile, stack_replicas
from jaxserve.core.types import Trace
from jaxserve.evaluation.replay import replay_prefix, replay_prefix_arrays
from jaxserve.traces import find as find_trace
from jaxserve.traces.prefix import PrefixTrace, build_prefix_tree, kv_prefix
from jaxserve.reference import continuous as rc
from jaxserve.reference.prefix import simulate_prefix
from tests.test_reference_prefix import B, hand_profile, random_case

N = 80  # requests per case (hand cases are padded with late private requests)
SIZES = dict(queue_buffer=16, max_seqs=4, prefix_blocks=64, tree_nodes=512, tree_depth=8)


def prefix_trace(arrival, prompt, output, prefix, block_tokens=B):
    """A `PrefixTrace` whose tree has the reference's id lists as paths."""
    ids = {}
    lists = [[ids.setdefault(x, len(ids)) for x in lst] for lst in prefix]
    tree, node = build_prefix_tree(lists, block_tokens)
    trace = Trace(np.asarray(arrival, float), np.asarray(prompt), np.asarray(output))
    return PrefixTrace(trace=trace, node=node,
                       full_blocks=np.asarray(prompt) // block_tokens, tree=tree)


def pad(arrival, prompt, output, prefix, replica=None):
    """Pads a case to `N` requests: private 5-token prompts arriving 100 s apart after the
    case's requests are all done (they change nothing before them)."""
    k = N - len(arrival)
    start = float(np.max(arrival)) + 1000.0
    arrival = np.concatenate([arrival, start + 100.0 * np.arange(k)])
    prompt = np.concatenate([prompt, np.full(k, 5)])
    output = np.concatenate([output, np.ones(k, int)])
    replica = np.zeros(N, int) if replica is None else replica
    return arrival, prompt, output, list(prefix) + [[] for _ in range(k)], replica


def both(arrival, prompt, output, replica, profiles, prefix, caching=True):
    """(engine result, reference result) of one case."""
    got = jaxserve.replay_prefix([ReplicaProfile(**p) for p in profiles],
                                 prefix_trace(arrival, prompt, output, prefix), replica,
                                 caching=caching, audit=caching, **SIZES)
    want = simulate_prefix(np.asarray(arrival, float), np.asarray(prompt),
                           np.asarray(output), replica, profiles, prefix, caching=caching,
                           audit=True)
    return got, want


def assert_equal_to_reference(got, want, profiles, prompt):
    for k in ("dropped", "first_token", "finish", "preemptions"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    first = [c[0] if c else 0 for c in want["cached_tokens"]]
    np.testing.assert_array_equal(got["cached_tokens"], first, err_msg="cached_tokens")
    np.testing.assert_array_equal(got["cached_tokens_total"],
                                  [sum(c) for c in want["cached_tokens"]])
    for k, w in (("hit_tokens", "hit_tokens"), ("evictions", "evictions"),
                 ("shared_preemptions", "shared_preemptions"), ("iterations", "iterations"),
                 ("replica_preemptions", "replica_preemptions")):
        np.testing.assert_array_equal(got[k], want[w], err_msg=k)
    for r, acc in enumerate(want["accounting"]):
        _, fresh, unref, held = acc[-1] if acc else (0, profiles[r]["kv_blocks"], 0, 0)
        assert (got["fresh"][r], got["cached_unreferenced"][r], got["held"][r]) == (
            fresh, unref, held), r
    assert got["audit_failures"] == 0
    # The steps' info totals are the replicas' counters; hits are whole blocks.
    info = got["info"]
    for k in ("hit_tokens", "evictions", "shared_preemptions", "lookup_tokens",
              "lookup_blocks", "hit_blocks"):
        assert info["prefix_" + k] == got[k].sum(), k
    assert info["prefix_hit_tokens"] == got["cached_tokens_total"].sum()
    assert info["prefix_hit_blocks"] * B == info["prefix_hit_tokens"]
    assert info["prefix_lookup_blocks"] * B <= info["prefix_lookup_tokens"]
    # Admissions look up L = p + g tokens: p at the first, more after a preemption.
    lookup, first = info["prefix_lookup_tokens"], np.asarray(prompt)[~got["dropped"]].sum()
    assert lookup == first if got["preemptions"].sum() == 0 else lookup > first


# ---- hand cases (tests/test_reference_prefix.py's, with their hand-computed numbers) -----

HAND = {
    "hit": ([0.0, 4.0], [12, 12], [1, 1], [["x", "y"], ["x", "y"]], {},
            {"finish": [1.25, 4.75], "cached": [0, 8]}),
    "full_prompt_recomputes_last_block": (
        [0.0, 4.0], [8, 8], [1, 1], [["x", "y"], ["x", "y"]], {"kv_blocks": 16},
        {"finish": [1.0, 4.75], "cached": [0, 4]}),
    "lru_eviction": (
        [0.0, 2.0, 4.0, 6.0, 8.0], [8, 8, 16, 9, 17], [1] * 5,
        [["a1", "a2"], ["b1", "b2"], ["c1", "c2", "c3", "c4"], [], ["c1", "c2", "c3", "c4"]],
        {"kv_blocks": 6}, {"finish": [1.0, 3.0, 5.5, 7.0625, 8.8125], "cached": [0, 0, 0, 0, 12]}),
    "preempt_shared": ([0.0, 0.0], [9, 9], [5, 5], [["s1", "s2"], ["s1", "s2"]],
                       {"kv_blocks": 5}, {"finish": [3.5625, 4.125], "cached": [0, 8],
                                          "preemptions": [0, 1], "total": [0, 20]}),
    "shared_count_once": ([0.0, 1.0], [9, 9], [3, 1], [["x", "y"], ["x", "y"]],
                          {"kv_blocks": 4}, {"finish": [2.25, 1.6875], "cached": [0, 8]}),
    "arrival_at_iteration_end": ([0.0, 1.0], [8, 9], [1, 1], [["x", "y"], ["x", "y"]],
                                 {"kv_blocks": 3}, {"finish": [1.0, 1.5625], "cached": [0, 8]}),
    # B decodes 19 tokens on 6 blocks: its decode blocks take the fresh blocks, then evict
    # A's cached ones (the tail block first); C, with A's prefix, then misses.
    "decode_evicts": ([0.0, 2.0, 30.0], [8, 4, 9], [1, 19, 1],
                      [["a1", "a2"], [], ["a1", "a2"]], {"kv_blocks": 6},
                      {"cached": [0, 0, 0]}),
}


@pytest.mark.parametrize("name", list(HAND))
def test_hand_cases_equal_reference(name):
    arrival, prompt, output, prefix, kw, expect = HAND[name]
    n = len(arrival)
    arrival, prompt, output, prefix, replica = pad(np.asarray(arrival), np.asarray(prompt),
                                                   np.asarray(output), prefix)
    profiles = [hand_profile(**kw)]
    got, want = both(arrival, prompt, output, replica, profiles, prefix)
    assert_equal_to_reference(got, want, profiles, prompt)
    if "finish" in expect:
        assert got["finish"][:n].tolist() == expect["finish"]
    assert got["cached_tokens"][:n].tolist() == expect["cached"]
    if "preemptions" in expect:
        assert got["preemptions"][:n].tolist() == expect["preemptions"]
        assert got["cached_tokens_total"][:n].tolist() == expect["total"]
    if name == "decode_evicts":
        assert got["evictions"][0] >= 2


def test_decode_run_skip_takes_and_caches_blocks_as_every_boundary_does():
    """B decodes 19 tokens on 6 blocks: its decode blocks take the fresh blocks, then evict
    A's cached ones. The closed-form decode-run skip (`advance(decode_runs=True)`, the
    default) must leave the block pool, the clocks and the counters exactly as a boundary per
    iteration does (`decode_runs=False`: at least B's 18 decode iterations), with the pool
    audit passing at every boundary, in far fewer boundaries."""
    prof = stack_replicas([ReplicaProfile(**hand_profile(kv_blocks=6))])
    tables = CB.prefix_tables(np.array([-1, 0]), np.array([1, 2]), B)
    route = jax.jit(lambda rep, r, node: CB.route(rep, prof, r, 0, node=node, tables=tables))
    req = lambda i, p, o: Q.Request(  # noqa: E731
        arrival=jnp.float32(0.0), prompt=jnp.float32(p), output=jnp.float32(o),
        estimate=jnp.float32(o), size_class=jnp.int32(0), req_id=jnp.int32(i))
    ends = {}
    for skip in (True, False):
        adv = jax.jit(lambda rep, h: CB.advance(rep, prof, h, 1.0, tables=tables,
                                                decode_runs=skip, audit=True))
        rep = CB.empty_replicas(1, 16, 4, True, prefix_blocks=6)
        rep, _, _ = route(rep, req(0, 8, 1), 1)
        rep, _, _, _ = adv(rep, 2.0)
        rep = CB.rebase(rep, 2.0)
        assert CB.block_accounting(rep, prof)["cached_unreferenced"].tolist() == [2]
        rep, _, _ = route(rep, req(1, 4, 19), -1)
        rep, m, ex, _ = adv(rep, jnp.inf)
        assert int(ex["audit_failures"]) == 0
        assert rep.pc.evictions.tolist() == [2]
        ends[skip] = (rep, m, ex)
    (rep, m, ex), (rep0, m0, ex0) = ends[True], ends[False]
    assert int(ex0["boundaries"]) >= 18 and int(ex["boundaries"]) <= 4
    jax.tree.map(np.testing.assert_array_equal, rep, rep0)
    jax.tree.map(np.testing.assert_array_equal, m, m0)
    with pytest.raises(ValueError, match="tables"):
        CB.advance(rep, prof, 1.0, 1.0)


# ---- random shared-prefix workloads with eviction pressure and preemption -----------------

SEEDS = range(8)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_shared_prefix_workloads_equal_reference(seed):
    arrival, prompt, output, replica, profiles, prefix = random_case(seed, n=N)
    got, want = both(arrival, prompt, output, replica, profiles, prefix)
    assert_equal_to_reference(got, want, profiles, prompt)


@pytest.mark.parametrize("seed", range(4))
def test_decode_run_skip_equals_a_boundary_per_iteration(seed):
    """On random shared-prefix workloads (eviction pressure, preemptions, shared blocks) the
    closed-form decode-run skip gives every per-request and per-replica result of the
    engine that runs a boundary per iteration, in fewer boundaries."""
    arrival, prompt, output, replica, profiles, prefix = random_case(seed, n=N)
    runs = [jaxserve.replay_prefix([ReplicaProfile(**p) for p in profiles],
                                   prefix_trace(arrival, prompt, output, prefix), replica,
                                   audit=True, decode_runs=skip, **SIZES)
            for skip in (True, False)]
    fast, slow = runs
    assert fast["boundaries"] < slow["boundaries"], (fast["boundaries"], slow["boundaries"])
    assert fast["audit_failures"] == slow["audit_failures"] == 0
    for k in slow:
        if k not in ("boundaries", "audit_failures"):
            jax.tree.map(np.testing.assert_array_equal, fast[k], slow[k])


def test_random_workloads_exercise_every_rule():
    """Guards the test above against vacuity (reference only): hits, evictions, preemptions,
    preemptions of requests holding a block another running request holds, readmissions that
    hit the cache, drops, and ties between arrivals."""
    tot = np.zeros(7, int)
    for seed in SEEDS:
        arrival, prompt, output, replica, profiles, prefix = random_case(seed, n=N)
        out = simulate_prefix(arrival, prompt, output, replica, profiles, prefix)
        tot += [out["hit_tokens"].sum(), out["evictions"].sum(), out["preemptions"].sum(),
                out["shared_preemptions"].sum(),
                sum(any(c > 0 for c in cs[1:]) for cs in out["cached_tokens"]),
                out["dropped"].sum(), (np.diff(arrival) == 0).sum()]
    assert np.all(tot > 0), tot


def test_coarse_hash_blocks_equal_reference():
    """Trace identities on 8-token hash blocks, 4-token KV blocks (two KV blocks per tree
    node, as Mooncake's 512-token hashes over vLLM's 16-token blocks): the engine's mapping
    equals the reference fed `traces.prefix.kv_prefix`'s lists."""
    rng = np.random.default_rng(7)
    arrival, prompt, output, replica, profiles, _ = random_case(2, n=N)
    lists = []
    for i in range(N):
        path = [("s", int(rng.integers(0, 2)))] + [
            ("c", d, int(rng.integers(0, 2))) for d in range(int(rng.integers(0, 3)))]
        tail = int(rng.integers(0, 8))
        prompt[i] = 8 * len(path) + tail
        lists.append(path + ([("own", i)] if tail else []))
    pt = prefix_trace(arrival, prompt, output, lists, block_tokens=8)
    got = replay_prefix([ReplicaProfile(**p) for p in profiles], pt, replica, audit=True,
                        **SIZES)
    ref_lists = [kv_prefix(pt, i, B) for i in range(N)]
    want = simulate_prefix(arrival, prompt, output, replica, profiles, ref_lists, audit=True)
    assert_equal_to_reference(got, want, profiles, prompt)
    assert want["hit_tokens"].sum() > 0 and want["evictions"].sum() > 0


# ---- flag off, vmap, validation ------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_caching_off_is_todays_engine(seed):
    """Without a prefix cache the driver runs the unchanged engine path: equal per request
    to `jaxserve.replay` on LLMRouting-v0 and to `jaxserve/reference/continuous.py`."""
    arrival, prompt, output, replica, profiles, prefix = random_case(seed, n=N)
    profs = [ReplicaProfile(**p) for p in profiles]
    got, _ = both(arrival, prompt, output, replica, profiles, prefix, caching=False)
    env, params = jaxserve.make("LLMRouting-v0", replicas=profs, queue_buffer=16, max_seqs=4)
    today = jaxserve.replay(env, params, Trace(arrival, prompt, output), actions=replica)
    want = rc.simulate(arrival, prompt, output, replica, profiles)
    for k in ("dropped", "first_token", "finish", "preemptions"):
        np.testing.assert_array_equal(got[k], today[k], err_msg=k)
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert want["preemptions"].sum() > 0 or seed == 1
    assert got["cached_tokens"].sum() == 0


def test_vmap_over_workloads_equals_single_runs():
    cases = []
    for seed in range(3):
        arrival, prompt, output, replica, profiles, prefix = random_case(seed, n=N)
        pt = prefix_trace(arrival, prompt, output, prefix)
        tables = CB.prefix_tables(pt.tree.parent, pt.tree.depth, B, 512, 8)
        cases.append(dict(
            prof=stack_replicas([ReplicaProfile(**p) for p in profiles]), tables=tables,
            gaps=jnp.asarray(np.append(np.diff(arrival), np.inf), jnp.float32),
            prompt=jnp.asarray(prompt, jnp.float32), output=jnp.asarray(output, jnp.float32),
            node=jnp.asarray(pt.node, jnp.int32), replica=jnp.asarray(replica, jnp.int32)))
    static = dict(num_replicas=2, queue_buffer=16, max_seqs=4, blocks=64)

    def run(c):
        rep, log, dropped, _, _tot, _ = replay_prefix_arrays(
            c["prof"], c["tables"], c["gaps"], c["prompt"], c["output"], c["node"],
            c["replica"], **static)
        return (log, dropped, rep.pc.hit_tokens, rep.pc.evictions, rep.iterations)

    batched = jax.vmap(run)(jax.tree.map(lambda *x: jnp.stack(x), *cases))
    for i, c in enumerate(cases):
        single = run(c)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[i], b),
                     batched, single)
    assert int(batched[2].sum()) > 0


def test_invalid_configuration_is_refused():
    arrival, prompt, output, replica, profiles, prefix = random_case(0, n=N)
    profs = [ReplicaProfile(**p) for p in profiles]
    pt = prefix_trace(arrival, prompt, output, prefix, block_tokens=6)
    with pytest.raises(ValueError, match="block_tokens"):
        replay_prefix(profs, pt, replica)
    pt = prefix_trace(arrival, prompt, output, prefix)
    with pytest.raises(ValueError, match="prefix_blocks"):
        replay_prefix(profs, pt, replica, queue_buffer=16, prefix_blocks=2)
    with pytest.raises(ValueError, match="actions"):
        replay_prefix(profs, pt, replica + 5, queue_buffer=16)
    with pytest.raises(ValueError, match="parent"):
        CB.prefix_tables(np.array([0]), np.array([1]), B)
    with pytest.raises(ValueError, match="depth"):
        CB.prefix_tables(np.array([-1, 0]), np.array([1, 3]), B)


MOONCAKE = find_trace("mooncake_conversation")


@pytest.mark.skipif(MOONCAKE is None, reason="Mooncake trace not available (set "
                    "JAXSERVE_TRACES_DIR or run `jaxserve-traces fetch mooncake_conversation`)")
def test_real_mooncake_prefixes_equal_reference():
    """The first 40 real conversation requests (512-token hash blocks over 16-token KV
    blocks: 32 KV blocks per tree node) on one replica of 1200 blocks, as
    `tests/test_traces_mooncake.py` runs the reference: equal preemptions, drops, cached
    tokens, hits, evictions and shared preemptions; times equal to 1e-4 s (their span is
    ~576 s, where a float32 ulp is 6.1e-5 s, and `delta = 2^-20` s per token is finer than
    that, so the engine's float32 clock rounds where the float64 reference does not)."""
    from jaxserve.traces.mooncake import load_mooncake
    from jaxserve.traces.prefix import path_nodes

    mt = load_mooncake(MOONCAKE)
    n = 40
    prof = dict(c0=0.5, alpha=2.0 ** -12, alpha2=0.0, beta=0.0, gamma=0.0, delta=2.0 ** -20,
                kv_blocks=1200, block_size=16, max_seqs=8, max_tokens=4096,
                chunked_prefill=True, watermark=0.0, queue_cap=64)
    arrival = np.ceil(mt.trace.arrival_s[:n] * 4) / 4
    prompt = mt.trace.prompt_tokens[:n]
    output = np.minimum(mt.trace.output_tokens[:n], 64)
    # The 40 requests' sub-tree (same paths), so the tables stay small.
    tree, node = build_prefix_tree([path_nodes(mt.tree, int(mt.node[i])) for i in range(n)],
                                   mt.tree.block_tokens)
    pt = PrefixTrace(trace=Trace(arrival, prompt, output), node=node,
                     full_blocks=prompt // 512, tree=tree)
    got = replay_prefix([ReplicaProfile(**prof)], pt, np.zeros(n, int), queue_buffer=64)
    want = simulate_prefix(arrival, prompt, output, np.zeros(n, int), [prof],
                           [kv_prefix(mt, i, 16) for i in range(n)])
    np.testing.assert_array_equal(got["dropped"], want["dropped"])
    np.testing.assert_array_equal(got["preemptions"], want["preemptions"])
    ok = ~want["dropped"]
    for k in ("first_token", "finish"):
        np.testing.assert_allclose(got[k][ok], want[k][ok], rtol=0, atol=1e-4, err_msg=k)
    np.testing.assert_array_equal(got["cached_tokens"],
                                  [c[0] if c else 0 for c in want["cached_tokens"]])
    for k in ("hit_tokens", "evictions", "shared_preemptions"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert want["hit_tokens"][0] > 0 and want["evictions"][0] > 0
    assert want["shared_preemptions"][0] > 0


def test_free_queue_order_is_argsorts_stable_order():
    """`free_order` (vector comparisons, no sort) returns `jnp.argsort`'s stable order of the
    free blocks by stamp, the rest after them by index, and its inverse, on random pools with
    tied stamps, referenced blocks and blocks beyond `kv_blocks`."""
    rng = np.random.default_rng(0)
    m = 37
    for _ in range(20):
        pc = CB.empty_prefix_cache(1, 2, 2, m)
        pc = jax.tree.map(lambda a: a[0], pc)
        pc = pc.replace(ref=jnp.asarray(rng.integers(0, 3, m) * (rng.random(m) < 0.4),
                                         jnp.int32),
                        stamp=jnp.asarray(rng.integers(-5, 6, m), jnp.int32))
        exists = jnp.arange(m) < int(rng.integers(1, m + 1))
        order, rank = KB.free_order(pc, exists)
        want = jnp.argsort(jnp.where((pc.ref == 0) & exists, pc.stamp, KB.I32_MAX), stable=True)
        np.testing.assert_array_equal(order, want)
        np.testing.assert_array_equal(rank[order], np.arange(m))


def test_lookup_equals_the_pairwise_identity_match():
    """`_lookup` (per pool block: its position in the request, a scatter-min of `born`)
    equals the definition it replaced: match every request block's identity against every
    cached block, the first inserted copy per block, the longest leading run within the cap.
    Random pools of shared blocks (on and off the request's path, at every offset), its own
    and other requests' private blocks, uncached blocks and several copies per identity."""
    rng = np.random.default_rng(1)
    parent = np.array([-1, 0, 1, 2, 0, 4, -1, 6, 3, 8])  # two roots, depths up to 5
    depth = np.array([1, 2, 3, 4, 2, 3, 1, 2, 5, 6])
    tables = CB.prefix_tables(parent, depth, block_tokens=8)
    b, m = 4, 40
    per = 8 // b

    def pairwise(pc, owner, code, cap):
        match = (pc.cached[None, :] & (pc.owner[None, :] == owner[:, None])
                 & (pc.code[None, :] == code[:, None]))
        first = jnp.argmin(jnp.where(match, pc.born[None, :], KB.I32_MAX), -1)
        hit = match.any(-1) & (jnp.arange(m) < cap)
        return int(jnp.argmin(jnp.concatenate([hit, jnp.zeros((1,), bool)]))), first

    lookup = jax.jit(lambda pc, node, nsh, rid, cap: PC.lookup(pc, tables, node, nsh, rid,
                                                                 b, cap))
    hits = 0
    for _ in range(60):
        node = int(rng.integers(-1, len(parent)))
        nsh = 0 if node < 0 else int(rng.integers(0, depth[node] * per + 1))
        rid = int(rng.integers(0, 3))
        owner, code = PC.identities(tables, node, nsh, rid, b, m)
        # Pool blocks: copies of the request's own identities, shared blocks of random nodes
        # and offsets, private blocks of requests 0-2.
        pick = rng.integers(0, m, m)
        rand_node = rng.integers(0, len(parent), m)
        rand_sh = rand_node * per + rng.integers(0, per, m)
        kind = rng.integers(0, 3, m)
        pc = jax.tree.map(lambda a: a[0], CB.empty_prefix_cache(1, 2, 2, m))
        pc = pc.replace(
            owner=jnp.asarray(np.where(kind == 0, np.asarray(owner)[pick],
                                       np.where(kind == 1, -1, rng.integers(0, 3, m))),
                              jnp.int32),
            code=jnp.asarray(np.where(kind == 0, np.asarray(code)[pick],
                                      np.where(kind == 1, rand_sh, rng.integers(0, m, m))),
                             jnp.int32),
            cached=jnp.asarray(rng.random(m) < 0.8),
            born=jnp.asarray(rng.permutation(m), jnp.int32))
        cap = int(rng.integers(0, m + 1))
        h, first = lookup(pc, node, nsh, rid, cap)
        want_h, want_first = pairwise(pc, owner, code, cap)
        assert int(h) == want_h
        np.testing.assert_array_equal(np.asarray(first)[:want_h], np.asarray(want_first)[:want_h])
        hits += want_h
    assert hits > 20  # the cases do find cached prefixes (48 blocks with this seed)


@pytest.mark.parametrize("max_depth", [None, 64, 300])
def test_ancestor_equals_a_parent_walk(max_depth):
    """`ancestor` (binary lifting over `PrefixTables.up`) equals walking parent links, for
    every node and every depth on its path, with the tables' levels padded or not."""
    rng = np.random.default_rng(2)
    parent = [-1]
    for k in range(1, 300):  # a random tree whose deepest paths reach depth ~ 30
        parent.append(int(rng.integers(max(-1, k - 12), k)) if rng.random() < 0.9 else -1)
    parent = np.asarray(parent)
    depth = np.ones(len(parent), int)
    for k, p in enumerate(parent):
        depth[k] = 1 if p < 0 else depth[p] + 1
    tables = CB.prefix_tables(parent, depth, block_tokens=8, max_depth=max_depth)
    nodes, targets, want = [], [], []
    for k in range(len(parent)):
        chain = [k]
        while parent[chain[-1]] >= 0:
            chain.append(int(parent[chain[-1]]))
        for a in chain:
            nodes.append(k)
            targets.append(depth[a])
            want.append(a)
    got = jax.jit(lambda n, d: CB.ancestor(tables, n, d))(jnp.asarray(nodes), jnp.asarray(targets))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert int(CB.ancestor(tables, -1, 1)) == -1
    assert depth.max() > 16  # more than 4 levels of lifting are used


def test_free_order_by_sort_equals_the_pairwise_order(monkeypatch):
    """Past `QUADRATIC_ORDER_MAX` blocks the free queue is ordered by a stable sort; both
    ways give the same order and ranks (random holds, stamps with ties, missing blocks)."""
    m = 300
    rng = np.random.default_rng(7)
    pc = CB.empty_prefix_cache(1, 4, 4, m)
    pc = jax.tree.map(lambda a: a[0], pc)
    pc = pc.replace(ref=jnp.asarray(rng.integers(0, 3, m), jnp.int32),
                    stamp=jnp.asarray(rng.integers(-50, 50, m), jnp.int32))
    exists = jnp.arange(m) < m - 17
    pairwise = KB.free_order(pc, exists)
    monkeypatch.setattr(KB, "QUADRATIC_ORDER_MAX", 16)
    by_sort = KB.free_order(pc, exists)
    np.testing.assert_array_equal(np.asarray(pairwise[0]), np.asarray(by_sort[0]))
    np.testing.assert_array_equal(np.asarray(pairwise[1]), np.asarray(by_sort[1]))
