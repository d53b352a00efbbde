"""Production cache-aware routers for LLMPrefixRouting-v0, at their published defaults.

Same signature as every jaxserve policy: `policy(key, obs, state, params) -> int32 replica`,
pure JAX, jit- and vmap-safe, registered with kind "prefix_routing" (`policies.get(name)`).
They name replicas by index; the registered LLMPrefixRouting-v0 is ranked (its action is a
rank), so act there with `env.replica_policy(router)`. The production routers are
llmd_scorers, dynamo_kv, sglang_cache_aware, aibrix_prefix_cache and session_affinity;
`most_cached`, registered beside them with the same kind, is no production router's rule: the
plain cache-first baseline, the ranked environment's rank 0. `policies.names("prefix_routing")`
lists them all; each function stays importable from this module.
Each reads only what the real router reads (../shared/ROUTERS.md, "Cache-aware routers"):

* the replicas' reported cached blocks of the pending request
  (`envs.llm_routing.pending_cached_blocks`: the leading prompt blocks held in each
  replica's cache, referenced or not, as llm-d's precise prefix scorer and Dynamo's KV
  router learn them from the replicas' KV events; SGLang and AIBrix approximate this with
  a router-side tree of the prompts they sent, which here is replaced by the exact view);
* the prompt length, and load counters: waiting and running requests, KV blocks held.

Never output lengths, true or estimated (the rules use none). Where a replica would drop
the request (queue full, or it can never fit: `policies.llm_routing.would_drop`) it is
skipped unless every replica would drop it, as in `policies.llm_routing`: a gateway learns
a full queue from the 429/503 it returns. Ties go to the lowest index (the real routers
break them at random or by map order); the hand-worked cases in
tests/test_prefix_routing.py avoid ties where that matters.

llm-d's, SGLang's and AIBrix's rules also take their weights or thresholds as traceable
parameters (`llmd_weighted_route`, `sglang_route`, `aibrix_route`; policies of other settings
from `llmd_weighted`, `sglang_thresholds`, `aibrix_thresholds`), which
`agents.experiments.prefix_study` fits on tuning data.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core import continuous as CB
from jaxserve.envs.llm_routing import pending_cached_blocks, pending_node
from jaxserve.policies.llm_routing import in_system, would_drop
from jaxserve.policies.registry import register_function

KIND = "prefix_routing"

# llm-d inference scheduler: scorer weights of its default profile.
LLMD_WEIGHTS = {"queue": 2.0, "kv_cache_utilization": 2.0, "prefix_cache": 3.0}
LLMD_DEFAULT = (LLMD_WEIGHTS["queue"], LLMD_WEIGHTS["kv_cache_utilization"],
                LLMD_WEIGHTS["prefix_cache"])  # `llmd_score`'s order
# NVIDIA Dynamo KV router: overlap weight 1.0, temperature 0 (argmin).
DYNAMO_OVERLAP_WEIGHT = 1.0
# SGLang router cache_aware defaults.
SGLANG_CACHE_THRESHOLD = 0.3
SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5
# The same, in `sglang_route`'s order.
SGLANG_DEFAULT = (SGLANG_CACHE_THRESHOLD, SGLANG_BALANCE_ABS, SGLANG_BALANCE_REL)
# AIBrix prefix-cache: imbalance guard (absolute) and standard-deviation factor.
AIBRIX_IMBALANCE_ABS = 8
AIBRIX_STD_FACTOR = 1.0
AIBRIX_DEFAULT = (AIBRIX_IMBALANCE_ABS, AIBRIX_STD_FACTOR)  # in `aibrix_route`'s order
# Consistent hashing: virtual points per replica on the ring.
RING_POINTS = 40


def _open(state, params) -> jax.Array:
    """Replicas that would accept the request; all of them if none would. `(R,)` bool."""
    bad = would_drop(state, params)
    return ~bad | bad.all()


def _argmax_open(score, state, params) -> jax.Array:
    return jnp.argmax(jnp.where(_open(state, params), score, -jnp.inf)).astype(jnp.int32)


def _argmin_open(cost, state, params) -> jax.Array:
    return jnp.argmin(jnp.where(_open(state, params), cost, jnp.inf)).astype(jnp.int32)


def prompt_blocks(state, params) -> jax.Array:
    """Blocks of the pending prompt at each replica's block size, `ceil(p / b)`. `(R,)`
    float32."""
    b = params.gpus.block_size.astype(jnp.float32)
    return jnp.ceil(state.pending.prompt / b)


def cached_fraction(state, params) -> jax.Array:
    """Cached tokens of the pending prompt at each replica over its prompt tokens, in
    [0, 1]. `(R,)` float32."""
    hit = pending_cached_blocks(state, params) * params.gpus.block_size
    return jnp.minimum(hit / jnp.maximum(state.pending.prompt, 1.0), 1.0)


def llmd_score(weights, state, params) -> jax.Array:
    """llm-d's weighted score of every replica, `weights = (queue, kv_cache_utilization,
    prefix_cache)` (traceable: a `(3,)` array or a tuple). Scorers, each in [0, 1]: queue
    `(max - q) / (max - min)` with `q` the replica's waiting requests (vLLM's
    `num_requests_waiting`, preempted ones included; 1 for every replica when all are
    equal), KV cache `1 - held / kv_blocks` (vLLM's usage counts cached-unreferenced blocks
    as free), prefix cache `matched / total` blocks of the prompt (the precise scorer's
    view). `(R,)` float32."""
    w = jnp.asarray(weights, jnp.float32)
    q = state.cluster.queues.count.astype(jnp.float32)
    lo, hi = q.min(), q.max()
    queue = jnp.where(hi > lo, (hi - q) / jnp.maximum(hi - lo, 1.0), 1.0)
    kv = 1.0 - CB.kv_used(state.cluster, params.gpus) / params.gpus.kv_blocks
    prefix = pending_cached_blocks(state, params) / jnp.maximum(prompt_blocks(state, params), 1.0)
    return w[0] * queue + w[1] * kv + w[2] * prefix


def llmd_weighted_route(weights, state, params) -> jax.Array:
    """The replica llm-d's scheduler picks with scorer `weights` (`llmd_score`): the argmax
    over the replicas that would accept the request. int32."""
    return _argmax_open(llmd_score(weights, state, params), state, params)


def llmd_weighted(weights) -> Callable:
    """llm-d's weighted-scorers router with other weights than its defaults (`llmd_score`'s
    order: queue, kv_cache_utilization, prefix_cache), e.g. weights fitted on tuning data
    (`agents.experiments.prefix_study.fit_llmd`). A policy `(key, obs, state, params) ->
    int32 replica`."""
    w = tuple(float(x) for x in weights)
    if len(w) != 3 or not all(np.isfinite(w)) or min(w) < 0 or max(w) <= 0:
        raise ValueError(f"llm-d weights must be 3 finite non-negative numbers, not all 0; "
                         f"got {weights}")

    def route(key, obs, state, params):
        return llmd_weighted_route(w, state, params)
    route.__doc__ = f"llm-d weighted scorers, weights (queue, kv, prefix) = {w}."
    return route


def llmd_scorers(key, obs, state, params):
    """llm-d inference scheduler (EPP), weighted scorers, argmax of
    `2 * queue + 2 * kv_cache_utilization + 3 * prefix_cache` (`llmd_score`).

    Source (ROUTERS.md): llm-d/llm-d-inference-scheduler `config/charts/epplib/templates/
    _config.yaml` (weights queue 2, kv-cache-utilization 2, prefix-cache 3) and
    `pkg/epp/framework/plugins/scheduling/scorer/*/README.md` (each scorer's formula);
    version: not recorded in ROUTERS.md.
    """
    return llmd_weighted_route(LLMD_DEFAULT, state, params)


def dynamo_kv(key, obs, state, params):
    """NVIDIA Dynamo KV router at temperature 0: argmin of `1.0 * prefill_blocks +
    active_blocks`, `prefill_blocks` the prompt's blocks not cached at the replica
    (`ceil(p / b) - cached`), `active_blocks` the blocks its running requests hold.

    Source (ROUTERS.md): Dynamo docs "components/router", version 0.4 (overlap weight 1.0,
    temperature 0 = argmin; later releases name the weight "overlap credit").
    """
    prefill = prompt_blocks(state, params) - pending_cached_blocks(state, params)
    active = CB.kv_used(state.cluster, params.gpus)
    return _argmin_open(DYNAMO_OVERLAP_WEIGHT * prefill + active, state, params)


def sglang_route(thresholds, state, params) -> jax.Array:
    """The replica SGLang's `cache_aware` router picks with `thresholds = (cache_threshold,
    balance_abs_threshold, balance_rel_threshold)` (traceable: a `(3,)` array or a tuple):
    if the load is imbalanced (`max - min > abs` and `max > rel * min` over the replicas
    that would accept the request, load = in-flight requests, waiting plus running), the
    least loaded replica; else, if the best cached fraction of the prompt exceeds
    `cache_threshold`, the replica with the longest match; else the one with the "smallest
    tree", read here as the most free KV blocks (`kv_blocks - held`). int32."""
    th = jnp.asarray(thresholds, jnp.float32)
    ok = _open(state, params)
    load = in_system(state).astype(jnp.float32)
    lo = jnp.where(ok, load, jnp.inf).min()
    hi = jnp.where(ok, load, -jnp.inf).max()
    imbalanced = (hi - lo > th[1]) & (hi > th[2] * lo)
    frac = cached_fraction(state, params)
    best = jnp.where(ok, frac, -1.0).max()
    free = (params.gpus.kv_blocks - CB.kv_used(state.cluster, params.gpus)).astype(jnp.float32)
    least = _argmin_open(load, state, params)
    longest = _argmax_open(frac, state, params)
    roomiest = _argmax_open(free, state, params)
    cached = jnp.where(best > th[0], longest, roomiest)
    return jnp.where(imbalanced, least, cached).astype(jnp.int32)


def sglang_cache_aware(key, obs, state, params):
    """SGLang router `cache_aware` at its defaults (`sglang_route` with cache_threshold 0.3,
    balance_abs_threshold 64, balance_rel_threshold 1.5).

    Source (ROUTERS.md): sgl-project/sglang `sgl-router/py_src/sglang_router/router_args.py`
    (cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5) and the Rust
    router's cache-aware policy header comment; version: current defaults as recorded in
    ROUTERS.md (older releases: 0.5 / 32 / 1.0001). The router's approximate radix tree and
    its LRU eviction are replaced by the replicas' actual caches.
    """
    return sglang_route(SGLANG_DEFAULT, state, params)


def _thresholds(name: str, values, size: int) -> tuple[float, ...]:
    """`values` as `size` finite non-negative floats, else a ValueError naming `name`."""
    v = tuple(float(x) for x in values)
    if len(v) != size or not all(np.isfinite(v)) or min(v) < 0:
        raise ValueError(f"{name} thresholds must be {size} finite non-negative numbers, "
                         f"got {values}")
    return v


def sglang_thresholds(thresholds) -> Callable:
    """SGLang's `cache_aware` router with other thresholds than its defaults (`sglang_route`'s
    order: cache_threshold, balance_abs_threshold, balance_rel_threshold), e.g. fitted on
    tuning data (`agents.experiments.prefix_study.fit_sglang`). A policy `(key, obs, state,
    params) -> int32 replica`."""
    th = _thresholds("SGLang", thresholds, 3)

    def route(key, obs, state, params):
        return sglang_route(th, state, params)
    route.__doc__ = (f"SGLang cache_aware, thresholds (cache, balance_abs, balance_rel) = "
                     f"{th}.")
    return route


def aibrix_route(thresholds, state, params) -> jax.Array:
    """The replica AIBrix's `prefix-cache` router picks with `thresholds = (imbalance_abs,
    std_factor)` (traceable): if the request counts are imbalanced (`max - min >
    imbalance_abs`), the least-request replica; else, among replicas holding a prefix of the
    prompt, the longest match, ties to fewer requests, skipping replicas with more than
    `mean + std_factor * std` requests (population std over replicas); with no such replica,
    the least-request one. Requests = in flight at the replica (waiting plus running).
    int32."""
    th = jnp.asarray(thresholds, jnp.float32)
    ok = _open(state, params)
    load = in_system(state).astype(jnp.float32)
    imbalanced = load.max() - load.min() > th[0]
    frac = cached_fraction(state, params)
    within = load <= load.mean() + th[1] * load.std()
    eligible = ok & (frac > 0) & within
    top = jnp.where(eligible, frac, -1.0).max()
    pick = jnp.argmin(jnp.where(eligible & (frac == top), load, jnp.inf)).astype(jnp.int32)
    least = _argmin_open(load, state, params)
    return jnp.where(imbalanced | ~eligible.any(), least, pick).astype(jnp.int32)


def aibrix_prefix_cache(key, obs, state, params):
    """AIBrix gateway `prefix-cache` at its defaults (`aibrix_route` with imbalance_abs 8,
    std_factor 1).

    Source (ROUTERS.md): vllm-project/aibrix `pkg/plugins/gateway/algorithms/
    prefix_cache.go` (imbalance abs 8, standard-deviation factor 1), strategies list in
    `docs/source/features/gateway-plugins.rst`; version: as recorded in ROUTERS.md. (The
    file at commit 01de8a5 gates on `max > 2.0 * (mean + 1)` and `max - min >= 8` instead;
    this implements ROUTERS.md's published rule.)
    """
    return aibrix_route(AIBRIX_DEFAULT, state, params)


def aibrix_thresholds(thresholds) -> Callable:
    """AIBrix's `prefix-cache` router with other thresholds than its defaults
    (`aibrix_route`'s order: imbalance_abs, std_factor), e.g. fitted on tuning data
    (`agents.experiments.prefix_study.fit_aibrix`). A policy `(key, obs, state, params) ->
    int32 replica`."""
    th = _thresholds("AIBrix", thresholds, 2)

    def route(key, obs, state, params):
        return aibrix_route(th, state, params)
    route.__doc__ = f"AIBrix prefix-cache, thresholds (imbalance_abs, std_factor) = {th}."
    return route


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash (the murmur3 finaliser), uint32 -> uint32."""
    x = x.astype(jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def root_node(tables: CB.PrefixTables, node) -> jax.Array:
    """The depth-1 ancestor of a prefix-tree node (its first hash block), -1 for -1."""
    return CB.ancestor(tables, node, 1)


def ring_replica(key_hash: jax.Array, num_replicas: int) -> jax.Array:
    """Consistent-hash ring of `RING_POINTS` points per replica: the replica owning the
    first point at or after `key_hash` (wrapping). int32."""
    r = jnp.repeat(jnp.arange(num_replicas, dtype=jnp.uint32), RING_POINTS)
    v = jnp.tile(jnp.arange(RING_POINTS, dtype=jnp.uint32), num_replicas)
    points = _mix32(_mix32(r * jnp.uint32(1000003) + v) + jnp.uint32(0x9E3779B9))
    after = points >= key_hash
    cand = after | ~after.any()  # no point after the key: wrap to the ring's start
    return r[jnp.lexsort((points, ~cand))[0]].astype(jnp.int32)


def session_affinity(key, obs, state, params):
    """vLLM production stack `session` router: a consistent-hash ring keyed on the
    request's session; here the key is the root node of its prefix path (its first hash
    block: the system prompt in the synthetic workload, the conversation's first block in
    Mooncake). A request without a prefix node, or whose ring replica would drop it, goes
    to the replica with the fewest requests (the stack falls back to the lowest QPS, which
    it counts over a window; requests in flight stand in for it here).

    Source (ROUTERS.md): vllm-project/production-stack
    `src/vllm_router/routers/routing_logic.py` (`session`: hash ring on a session key,
    falls back to lowest QPS); version: as recorded in ROUTERS.md. The ring's hash is a
    32-bit murmur3 finaliser with 40 points per replica, not the stack's library hash.
    """
    root = root_node(params.tables, pending_node(state, params))
    target = ring_replica(_mix32(root.astype(jnp.uint32)), state.cluster.num_replicas)
    fallback = _argmin_open(in_system(state), state, params)
    use_ring = (root >= 0) & _open(state, params)[target]
    return jnp.where(use_ring, target, fallback).astype(jnp.int32)


def most_cached(key, obs, state, params):
    """Not a production router: the plain cache-first rule that the registered (ranked)
    LLMPrefixRouting-v0 puts at rank 0. The replica holding the most leading blocks of the
    pending prompt (`pending_cached_blocks`), ties to the fewest tokens in flight
    (`continuous.tokens_in_flight`: prompt plus output estimate of what it holds), then the
    lowest index; a replica that would drop the request is skipped unless all would. It has
    no load guard (SGLang's balance thresholds, llm-d's queue and KV scorers): the baseline a
    learned router must beat to show it learned when to leave the cache."""
    hit = pending_cached_blocks(state, params)
    best = jnp.max(jnp.where(_open(state, params), hit, -1))
    load = CB.tokens_in_flight(state.cluster)
    return _argmin_open(jnp.where(hit == best, load, jnp.inf), state, params)


def cache_guarded_route(guard, state, params) -> jax.Array:
    """`most_cached`'s replica unless its estimated tokens in flight exceed `guard` times the
    replicas' mean (`continuous.tokens_in_flight`, the mean floored at 1 token), else
    `jsq_tokens`' replica (fewest tokens in flight over KV capacity). `guard` traceable.
    int32."""
    cached = most_cached(None, None, state, params)
    load = CB.tokens_in_flight(state.cluster)
    over = load[cached] > jnp.asarray(guard, jnp.float32) * jnp.maximum(load.mean(), 1.0)
    cap = (params.gpus.kv_blocks * params.gpus.block_size).astype(jnp.float32)
    least = _argmin_open(load / cap, state, params)
    return jnp.where(over, least, cached).astype(jnp.int32)


def cache_guarded(guard: float) -> Callable:
    """Not a production router: `most_cached` with a load guard (`cache_guarded_route`):
    follow the cache unless the cached replica holds more than `guard` x the mean estimated
    tokens in flight, then the least loaded replica. The rule the learned router of
    docs/prefix_caching.md's study was seen to follow at system_prompts load 1 (it leaves
    the cached replica more often the more loaded that replica is), with its one threshold
    fitted on tuning data (`agents.experiments.prefix_study`, `guarded_tuned`). A policy
    `(key, obs, state, params) -> int32 replica`."""
    g = float(guard)
    if not np.isfinite(g) or g <= 0:
        raise ValueError(f"the load guard must be a finite number > 0, got {guard}")

    def route(key, obs, state, params):
        return cache_guarded_route(g, state, params)
    route.__doc__ = f"most_cached unless its replica holds > {g:g} x the mean tokens in flight."
    return route


def cache_or_shed(key, obs, state, params):
    """Not a production router, and not registered: the rule the learned routers of
    docs/prefix_caching.md's study converged to at system_prompts load 1.5 (found by replaying
    them beside it: `scripts/prefix_rule_check.py`). The replica holding the most cached
    blocks of the pending prompt **even when its queue is full** (the request is then
    dropped: load shedding instead of spilling a cached prompt to a cold replica), ties to
    the fewest estimated tokens in flight; with no cached block anywhere, `most_cached`.
    Every other router here skips a full replica (as a gateway does after a 429)."""
    hit = pending_cached_blocks(state, params)
    load = CB.tokens_in_flight(state.cluster)
    pick = jnp.argmin(jnp.where(hit == hit.max(), load, jnp.inf)).astype(jnp.int32)
    return jnp.where(hit.max() > 0, pick, most_cached(key, obs, state, params)).astype(jnp.int32)


# The production routers at their published defaults, then the cache-first baseline (no
# production router's rule).
for _fn in (llmd_scorers, dynamo_kv, sglang_cache_aware, aibrix_prefix_cache, session_affinity,
            most_cached):
    register_function(_fn.__name__, KIND, _fn)
