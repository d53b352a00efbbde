"""Replaying a whole trace through an environment with given routing decisions or a policy.

`replay` is how users and tests check schedules: it runs the trace through the environment's
own step function (trace mode, with a per-request log), drains the cluster at the end, and
returns the per-request schedule. The decisions are either given (`actions=`) or made by a
routing policy (`policy=`, the shared `policy(key, obs, state, params)` signature).

`replay_windows` runs many short windows of a trace (`traces.windows`) as episodes, all in
parallel, and returns per-window totals. Both run on the episode driver
(`evaluation.episodes`).

`replay_prefix` replays a trace with prefix identity (`traces.prefix.PrefixTrace`) on
continuous-batching replicas with automatic prefix caching (docs/prefix_caching.md) and
returns, besides the schedule, the cached tokens of every request; it drives the engine
directly (LLMRouting-v0 does not carry prefix identity yet).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core import continuous as CB
from jaxserve.core import engines
from jaxserve.core import queues as Q
from jaxserve.core.replica import stack_replicas
from jaxserve.core.sources import TraceArrays, trace_arrays
from jaxserve.core.types import Trace, validate_trace
from jaxserve.envs import common
from jaxserve.envs.llm_routing import LLMRouting
from jaxserve.envs.base import with_static
from jaxserve.envs.routing import Routing
from jaxserve.evaluation import episodes
from jaxserve.evaluation.evaluate import trace_env
from jaxserve.traces.prefix import validate_prefix_trace


def _replay_fold(num_gpus: int):
    """Per request: whether it was dropped, and the GPU it went to (clipped as the env does)."""
    def fold(acc, s: episodes.Step):
        return acc, (s.info["dropped"], jnp.clip(s.action, 0, num_gpus - 1))
    return fold


@partial(jax.jit, static_argnames=("env",))
def _run_actions(env, key, params: common.ServingParams, actions: jax.Array):
    """Steps `env` (trace mode) once per request with `actions[i]`; the last step drains."""
    obs, state = env.reset_env(key, params)
    keys = jax.random.split(jax.random.fold_in(key, 1), actions.shape[0])
    _, state, _, _, (dropped, _) = episodes.scan_steps(
        env, episodes.from_actions(actions), params, obs, state, keys, keys,
        fold=_replay_fold(env.num_gpus))
    return state.log, dropped


@partial(jax.jit, static_argnames=("env", "policy"))
def _run_policy(env, key, params: common.ServingParams, policy):
    """Steps `env` (trace mode) once per request with the policy's action; the last drains.

    Key layout: reset with `key`; step `i` with `split(fold_in(key, 1), n)[i]`, the policy
    with `fold_in(fold_in(key, 2), i)`.
    """
    obs, state = env.reset_env(key, params)
    n = params.trace.gap.shape[0]
    k_pol = jax.random.fold_in(key, 2)
    pol_keys = jax.vmap(lambda i: jax.random.fold_in(k_pol, i))(jnp.arange(n, dtype=jnp.int32))
    keys = jax.random.split(jax.random.fold_in(key, 1), n)
    _, state, _, _, (dropped, gpu) = episodes.scan_steps(
        env, episodes.from_policy(policy, params), params, obs, state, pol_keys, keys,
        fold=_replay_fold(env.num_gpus))
    return state.log, dropped, gpu


def replay(env, params, trace: Trace, actions=None, *, policy=None,
           key=None) -> dict[str, np.ndarray]:
    """Runs every request of `trace` through `env`'s cluster and drains it.

    Args:
      env (Environment): a routing environment such as `make("Routing-v0")[0]` or
        `make("LLMRouting-v0")[0]` (continuous batching; see `token_log` for its result).
      params (ServingParams): its parameters (GPU profiles, SLO, estimate settings).
      trace: the requests (`jaxserve.Trace`), arrival times in seconds.
      actions (array-like | None): `(n,)` integer GPU index for each request, in `[0, num_gpus)`.
      policy (callable | None): instead of `actions`, a routing policy `policy(key, obs, state, params) -> GPU`
        that routes every request as it arrives (an out-of-range choice is clipped, as the
        environment does, and reported as the clipped GPU).
      key (jax.Array | None): PRNG key for noisy output estimates and the policy (default
        `PRNGKey(0)`).

    Returns:
      dict of numpy arrays, one entry per request: `arrival` (s, float64), `start`, `finish`
      (s, float64; NaN if dropped), `gpu` (int), `dropped` (bool), `batch` (int, global batch
      id in order of (start, gpu); -1 if dropped).

    Raises:
      ValueError: invalid trace, `actions` of the wrong length, type or range, or neither or
        both of `actions` and `policy`.
    """
    tr = validate_trace(trace)
    n = len(tr)
    num_gpus = int(getattr(env, "num_gpus", 0))
    if num_gpus < 1 or not hasattr(env, "replace_static"):
        raise ValueError(f"replay needs a jaxserve routing environment, got {env!r}")
    if getattr(env, "prefix", False):
        # A plain Trace has no prefix nodes to line up with params.node.
        raise ValueError("replay does not carry prefix nodes; replay LLMPrefixRouting-v0's "
                         "decisions with replay_prefix(profiles, prefix_trace, actions)")
    if policy is not None:
        if actions is not None:
            raise ValueError("give replay either actions= or policy=, not both")
        if not isinstance(env, (Routing, LLMRouting)):
            raise ValueError("replay(policy=...) needs a Routing or LLMRouting environment")
        if not callable(policy):
            raise ValueError(f"policy must be callable, got {type(policy).__name__}")
        env.check_params(params)
        key = jax.random.PRNGKey(0) if key is None else key
        trace_params = params.replace(trace=trace_arrays(tr))
        log, dropped, gpu = _run_policy(trace_env(env, n), key, trace_params, policy)
        return _schedule_of(env, tr, np.asarray(gpu), log, dropped)
    if actions is None:
        raise ValueError("replay needs actions= (one GPU index per request) or policy=")
    acts = np.asarray(actions)
    if acts.ndim != 1 or acts.shape[0] != n:
        raise ValueError(f"actions must have one entry per request: expected shape ({n},), "
                         f"got {acts.shape}")
    if not np.issubdtype(acts.dtype, np.integer):
        if not np.all(np.isfinite(acts)) or np.any(acts != np.round(acts)):
            raise ValueError("actions must be integer GPU indices")
    if np.any(acts < 0) or np.any(acts >= num_gpus):
        bad = int(np.flatnonzero((acts < 0) | (acts >= num_gpus))[0])
        raise ValueError(f"actions[{bad}] = {acts[bad]} is not a GPU index in [0, {num_gpus})")
    env.check_params(params)
    key = jax.random.PRNGKey(0) if key is None else key
    trace_params = params.replace(trace=trace_arrays(tr))
    log, dropped = _run_actions(trace_env(env, n), key, trace_params,
                                jnp.asarray(acts, jnp.int32))
    return _schedule_of(env, tr, acts, log, dropped)


def _schedule_of(env, tr: Trace, gpu: np.ndarray, log, dropped) -> dict:
    """The per-request result of a replay, in the form of the environment's engine."""
    if isinstance(env, LLMRouting):
        return token_log(tr, gpu, log, dropped)
    return per_request_log(tr, gpu, log, dropped)


def token_log(tr: Trace, replica: np.ndarray, log, dropped) -> dict:
    """Per-request outcome of an LLMRouting-v0 replay in absolute float64 seconds.

    `arrival`, `replica`, `first_token`, `finish` (NaN if dropped), `dropped` and
    `preemptions`; the engine logs float32 spans from the arrival, added here to the
    float64 arrival.
    """
    dropped = np.asarray(dropped, bool)
    return {"arrival": tr.arrival_s.copy(), "replica": replica.astype(np.int64),
            "first_token": tr.arrival_s + np.asarray(log.ttft, np.float64),
            "finish": tr.arrival_s + np.asarray(log.e2e, np.float64), "dropped": dropped,
            "preemptions": np.where(dropped, 0, np.asarray(log.preemptions)).astype(np.int64)}


def per_request_log(tr: Trace, gpu: np.ndarray, log, dropped) -> dict:
    """The per-request schedule in absolute float64 seconds.

    The engine logs each request's wait and service as float32 spans; adding them to the
    float64 arrival keeps times exact to the spans' precision however long the trace.
    """
    wait = np.asarray(log.wait, np.float64)
    service = np.asarray(log.service, np.float64)
    start = tr.arrival_s + wait
    finish = start + service
    local = np.asarray(log.batch)
    dropped = np.asarray(dropped, bool)
    batch = np.full(len(tr), -1, np.int64)
    ok = ~dropped
    if ok.any():
        pairs = np.stack([gpu[ok].astype(np.int64), local[ok]], axis=1)
        uniq, inverse = np.unique(pairs, axis=0, return_inverse=True)
        first_start = np.full(len(uniq), np.inf)
        np.minimum.at(first_start, inverse.ravel(), start[ok])
        order = np.lexsort((uniq[:, 0], first_start))
        rank = np.empty(len(uniq), np.int64)
        rank[order] = np.arange(len(uniq))
        batch[ok] = rank[inverse.ravel()]
    return {"arrival": tr.arrival_s.copy(), "start": start, "finish": finish,
            "gpu": gpu.astype(np.int64), "dropped": dropped, "batch": batch}


@partial(jax.jit, static_argnames=("env", "policy", "num_steps"))
def _replay_windows(env, policy, num_steps, key, params, wins, actions):
    def one(key, tr, acts):
        p = params.replace(trace=tr)
        act = episodes.from_actions(acts) if policy is None else episodes.from_policy(policy, p)

        def init(obs, state):
            info = jax.eval_shape(env.step_env, key, state, jnp.int32(0), p)[4]
            zero = {"return": jnp.float32(0.0), "steps": jnp.int32(0)}
            return {**zero, **{k: jnp.zeros(v.shape, v.dtype) for k, v in info.items()}}

        def fold(tot, s: episodes.Step):
            vals = {"return": s.reward, "steps": jnp.int32(1), **s.info}
            tot = jax.tree.map(lambda acc, v: acc + jnp.where(s.live, v, jnp.zeros_like(v)),
                               tot, vals)
            return tot, jnp.where(s.live, s.action, -1)

        _, _, done, tot, taken = episodes.run_episode(env, act, p, key, num_steps, fold=fold,
                                                      init=init, start_done=True)
        tot["terminated"] = done
        tot["actions"] = taken
        # The draining step's `elapsed` runs to the last completion, so the episode's summed
        # `elapsed` is its span from first arrival to last completion.
        tot["makespan"] = tot["elapsed"]
        return tot

    keys = jax.random.split(key, wins.gap.shape[0])
    return jax.vmap(one)(keys, wins, actions)


def replay_windows(env, params, wins: TraceArrays,
                   policy: Callable | np.ndarray | jax.Array, *, key: jax.Array | None = None,
                   num_steps: int | None = None) -> dict[str, jax.Array]:
    """Runs every window as one episode of `env`, all windows in parallel (vmap, one program).

    Each window `w` becomes `params.replace(trace=wins[w])` on
    `env.replace_static(trace_len=L)`; the episode starts with `env.reset` and is stepped with
    `env.step_env` (no auto-reset, no `max_steps_in_episode` truncation: the window's end is
    the episode's end) until it terminates; steps after termination are no-ops.

    Args:
      env (Environment): a jaxserve environment (`Routing-v0`, `Batching-v0`).
      params (ServingParams): its parameters (the `trace` field is replaced per window).
      wins: windows from `windows(...)`, leaves `(W, L)` and `length (W,)`.
      policy: a function `policy(key, obs, state, params) -> action` (traced once, vmapped
        over windows; must be hashable, e.g. a module-level function), or an integer array of
        actions `(W, >= num_steps)`, step `t` of window `w` taking `actions[w, t]`.
      key: PRNG key (default `PRNGKey(0)`); window `w` uses the `w`-th split.
      num_steps: steps scanned per window (default `L`, one routing decision per request;
        Batching-v0 needs more decisions than requests, so pass e.g. `2 * L`).

    Returns:
      dict of `(W,)` arrays: `return` (summed reward), `steps` (decisions taken), every step
      `info` metric summed over the episode (`arrived`, `completed`, `dropped`, `latency_sum`,
      `slo_met`, `busy_time`, `in_system_time`, `elapsed`, `invalid_actions`),
      `terminated` (whether the window's episode ended within `num_steps`), `makespan`
      (seconds from the window's first arrival to its last completion, for a terminated
      episode: the summed `elapsed`, kept under this name; a busy fraction is
      `busy_time / (num_gpus * makespan)`), and `actions`
      `(W, num_steps)` int32: the action of each step, -1 after the episode ended (so a
      window can be replayed request by request, e.g. with `jaxserve.replay`).
    """
    if wins.gap.ndim != 2:
        raise ValueError(f"wins must have a leading window axis (W, L), got {wins.gap.shape}")
    length = int(wins.gap.shape[1])
    env_w = with_static(env, trace_len=length)
    steps = length if num_steps is None else int(num_steps)
    key = jax.random.PRNGKey(0) if key is None else key
    if callable(policy):
        pol, acts = policy, jnp.zeros((wins.gap.shape[0], 1), jnp.int32)
    else:
        acts = jnp.asarray(policy, jnp.int32)
        if acts.ndim != 2 or acts.shape[0] != wins.gap.shape[0]:
            raise ValueError(f"actions must have shape (W, steps) with W={wins.gap.shape[0]}, "
                             f"got {acts.shape}")
        pol = None
        if acts.shape[1] < steps:
            raise ValueError(f"actions must hold at least {steps} steps per window, got "
                             f"{acts.shape[1]}")
    return _replay_windows(env_w, pol, steps, key, params, wins, acts)




# ------------------------------------------------------------------ prefix-caching replays

@partial(jax.jit, static_argnames=("num_replicas", "queue_buffer", "max_seqs", "blocks",
                                   "audit", "decode_runs", "router"))
def replay_prefix_arrays(prof, tables, gaps, prompt, output, node, replica, *,
                         num_replicas: int, queue_buffer: int, max_seqs: int,
                         blocks: int | None, audit: bool = False, decode_runs: bool = True,
                         router=None):
    """Routes request `i` (arriving `gaps[i]` s after the previous one; the last gap `inf`
    drains) to `replica[i]` on continuous-batching replicas, with prefix caching when
    `blocks` is set: LLMRouting-v0's engine loop (`engines.route_and_run`: route, advance to
    the next arrival, rebase) over a given trace, carrying each request's prefix node. Pure and
    jittable; vmaps over workloads (every array argument). `decode_runs=False` turns the
    engine's closed-form decode-run skip off (a boundary per iteration: tests, benchmarks).
    `router`, a static function `router(replicas, profiles) -> int32`, chooses each request's
    replica from the engine's state at its arrival instead of `replica[i]` (a rule a real
    system applies inside the engine, e.g. vLLM's data-parallel balancer).

    Returns:
      (final `Replicas`, `TokenLog` (with cached tokens when caching), dropped `(n,)`,
      never_fit `(n,)`, totals over the steps' info of the keys `continuous.PREFIX_EXTRAS`
      plus `audit_failures` (boundaries where `prefix_audit` failed; 0 unless `audit`); all
      0 without caching) and `boundaries` (the engine's boundary passes); and the replica each
      request was routed to, `(n,)` int32.
    """
    n = gaps.shape[0]
    rep = engines.CONTINUOUS.empty(num_replicas, queue_buffer, max_seqs, with_ids=True,
                                   prefix_blocks=blocks)
    log = engines.CONTINUOUS.empty_log(n, prefix=blocks is not None)
    tab = tables if blocks is not None else None

    keys = CB.PREFIX_EXTRAS + ("audit_failures", "boundaries")

    def step(carry, x):
        rep, log, tot = carry
        i, gap, p, o, nd, r = x
        if router is not None:
            r = router(rep, prof)
        req = Q.Request(arrival=jnp.float32(0.0), prompt=p, output=o, estimate=o,
                        size_class=jnp.int32(0), req_id=i)
        rep, dropped, flags, _, ex, log = engines.route_and_run(
            engines.CONTINUOUS, rep, prof, req, r, gap, ~jnp.isfinite(gap), jnp.float32(1.0),
            log, route_kw=dict(node=nd, tables=tab),
            advance_kw=dict(tables=tab, decode_runs=decode_runs,
                            audit=audit and blocks is not None))
        tot = {k: tot[k] + ex.get(k, jnp.int32(0)) for k in keys}
        return (rep, log, tot), (dropped, flags["never_fit"], r)

    xs = (jnp.arange(n, dtype=jnp.int32), gaps, prompt, output, node, replica)
    tot0 = {k: jnp.int32(0) for k in keys}
    (rep, log, tot), (dropped, never, routed) = jax.lax.scan(step, (rep, log, tot0), xs)
    return rep, log, dropped, never, tot, routed


def replay_prefix(profiles, ptrace, actions=None, *, caching: bool = True,
                  queue_buffer: int = 8, max_seqs: int | None = None, audit: bool = False,
                  prefix_blocks: int | None = None, tree_nodes: int | None = None,
                  tree_depth: int | None = None, decode_runs: bool = True,
                  router=None) -> dict[str, np.ndarray]:
    """Replays a trace with prefix identity (`traces.prefix.PrefixTrace`) on continuous-
    batching replicas with automatic prefix caching (docs/prefix_caching.md), routing request
    `i` to `actions[i]`, and drains.

    Args:
      profiles (Sequence[ReplicaProfile]): one per replica.
      ptrace (PrefixTrace): the trace; KV block `j` of a request is shared (docs section 9) when it
        lies on its tree path; `tree.block_tokens` must be a multiple of every `block_size`.
      actions (array-like | None): `(n,)` replica index per request (None with `router`).
      caching: False runs the engine without a prefix cache (today's engine exactly).
      queue_buffer: waiting slots per replica (>= every `queue_cap`).
      max_seqs: running slots (default: the largest `max_seqs`).
      audit: check the block pool at every boundary (`continuous.prefix_audit`; slow).
      prefix_blocks: static size (default: the largest `kv_blocks`); larger values, here and
        in `tree_nodes` and `tree_depth`, let differently sized cases share one compiled
        program (see `continuous.prefix_tables`).
      tree_nodes: static size (default: the tree's nodes).
      tree_depth: static size (default: the tree's depth).
      decode_runs: False runs a boundary per iteration instead of skipping fixed decode runs
        in closed form (same results; tests and benchmarks).
      router (callable | None): instead of `actions`, a static `router(replicas, profiles) -> int32` choosing
        each request's replica at its arrival from the engine's state (`replay_prefix_arrays`).

    Returns:
      `token_log`'s dict (its `replica`: where each request went) plus `cached_tokens`
      (tokens cached at the first admission, vLLM's `num_cached_tokens`; 0 if dropped),
      `cached_tokens_total` (over all admissions), and per replica `hit_tokens`,
      `evictions`, `shared_preemptions`, `lookup_tokens`, `lookup_blocks`, `hit_blocks`,
      `iterations`, `replica_preemptions`, `fresh`, `cached_unreferenced`, `held` (blocks
      after draining); `info`: the steps' info totals
      of `continuous.PREFIX_EXTRAS` (ints); `audit_failures` and `boundaries` (the engine's
      boundary passes) (ints). The cache counters are 0 without caching.

    Raises:
      ValueError: invalid trace, profiles, actions, sizes or block sizes (naming the field).
    """
    ptrace = validate_prefix_trace(ptrace)
    tr = ptrace.trace
    n = len(tr)
    prof = stack_replicas(profiles)
    r_n = len(profiles)
    if (actions is None) == (router is None):
        raise ValueError("give exactly one of actions and router")
    acts = np.zeros(n, np.int64) if actions is None else np.asarray(actions)
    if acts.shape != (n,) or not np.issubdtype(acts.dtype, np.integer):
        raise ValueError(f"actions must be ({n},) integers, got {acts.shape} {acts.dtype}")
    if np.any((acts < 0) | (acts >= r_n)):
        raise ValueError(f"actions must be replica indices in [0, {r_n})")
    node, tree = ptrace.node, ptrace.tree
    bs = np.asarray(prof.block_size)
    if np.any(tree.block_tokens % bs):
        raise ValueError(f"tree.block_tokens ({tree.block_tokens}) must be a multiple of every "
                         f"replica's block_size, got {bs.tolist()}")
    caps = np.asarray(prof.queue_cap)
    if queue_buffer < caps.max():
        raise ValueError(f"queue_buffer ({queue_buffer}) must be >= every queue_cap "
                         f"({int(caps.max())})")
    seqs = int(np.asarray(prof.max_seqs).max())
    max_seqs = seqs if max_seqs is None else int(max_seqs)
    if max_seqs < seqs:
        raise ValueError(f"max_seqs ({max_seqs}) must be >= every replica's max_seqs ({seqs})")
    tables = CB.prefix_tables(tree.parent, tree.depth, tree.block_tokens, tree_nodes,
                              tree_depth)
    gaps = np.append(np.diff(tr.arrival_s), np.inf).astype(np.float32)
    kv_max = int(np.asarray(prof.kv_blocks).max())
    if prefix_blocks is not None and prefix_blocks < kv_max:
        raise ValueError(f"prefix_blocks ({prefix_blocks}) must be >= every kv_blocks "
                         f"({kv_max})")
    blocks = (kv_max if prefix_blocks is None else int(prefix_blocks)) if caching else None
    rep, log, dropped, never, tot, routed = replay_prefix_arrays(
        prof, tables, jnp.asarray(gaps), jnp.asarray(tr.prompt_tokens, jnp.float32),
        jnp.asarray(tr.output_tokens, jnp.float32), jnp.asarray(node, jnp.int32),
        jnp.asarray(acts, jnp.int32), num_replicas=r_n, queue_buffer=int(queue_buffer),
        max_seqs=max_seqs, blocks=blocks, audit=bool(audit), decode_runs=bool(decode_runs),
        router=router)
    acts = np.asarray(routed, np.int64)
    out = token_log(tr, acts, log, np.asarray(dropped))
    out["never_fit"] = np.asarray(never, bool)
    zero_r = np.zeros(r_n, np.int64)
    if caching:
        out["cached_tokens"] = np.maximum(np.asarray(log.cached_first), 0).astype(np.int64)
        out["cached_tokens_total"] = np.asarray(log.cached_total, np.int64)
        pc = rep.pc
        for k in CACHE_COUNTERS:
            out[k] = np.asarray(getattr(pc, k), np.int64)
        for k, v in CB.block_accounting(rep, prof).items():
            out[k] = np.asarray(v, np.int64)
    else:
        out["cached_tokens"] = np.zeros(n, np.int64)
        out["cached_tokens_total"] = np.zeros(n, np.int64)
        for k in CACHE_COUNTERS:
            out[k] = zero_r.copy()
        used = np.asarray(CB.kv_used(rep, prof), np.int64)
        out["fresh"], out["cached_unreferenced"] = np.asarray(prof.kv_blocks) - used, zero_r
        out["held"] = used
    out["iterations"] = np.asarray(rep.iterations, np.int64)
    out["replica_preemptions"] = np.asarray(rep.preemptions, np.int64)
    out["info"] = {k: int(tot[k]) for k in CB.PREFIX_EXTRAS}
    out["audit_failures"] = int(tot["audit_failures"])
    out["boundaries"] = int(tot["boundaries"])
    return out


CACHE_COUNTERS = ("hit_tokens", "evictions", "shared_preemptions", "lookup_tokens",
                  "lookup_blocks", "hit_blocks")
