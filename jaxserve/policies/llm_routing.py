"""Routing heuristics for LLMRouting-v0 (continuous-batching replicas).

Same signature as every jaxserve policy: `policy(key, obs, state, params) -> int32 replica`,
pure JAX, jit- and vmap-safe. They read only what a real router knows: the pending request's
prompt and output *estimate*, each replica's waiting and running counts, KV blocks in use and
estimated tokens in flight; never true output lengths.

Replicas where the request would be dropped (queue holding `queue_cap` fresh requests, or the
request can never fit its KV cache / token budget) are skipped, unless every replica would
drop it. Ties go to the lowest index (`argmin`).

Registered with kind "llm_routing" (`policies.get(name, kind="llm_routing")`): jsq_requests,
jsq_tokens, least_kv, vllm_dp, sita_prompt (option `threshold`), and the generic random,
round_robin, power_of_two and least_marginal (`policies.generic`, registered once for
Routing-v0 and LLMRouting-v0). `sita_prompt` is also the name of a different Routing-v0
policy (kind "routing": a fitted SITA), so look it up with `kind="llm_routing"`;
`policies.names("llm_routing")` lists them all. Each function stays importable from this
module (`jsq_tokens`, `sita_prompt`...).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core import continuous as CB
from jaxserve.policies.generic import in_system
from jaxserve.policies.registry import Policy, register, register_function

KIND = "llm_routing"


def would_drop(state, params) -> jax.Array:
    """Whether routing the pending request to each replica drops it, `(R,)` bool."""
    c, prof, req = state.cluster, params.gpus, state.pending
    full = (c.queues.count - c.q_preempted) >= prof.queue_cap
    return full | CB.never_fits(prof, req.prompt, req.estimate)


def _argmin_open(cost, state, params) -> jax.Array:
    bad = would_drop(state, params)
    cost = jnp.where(bad & ~bad.all(), jnp.inf, cost)
    return jnp.argmin(cost).astype(jnp.int32)


def jsq_requests(key, obs, state, params):
    """Fewest requests waiting plus running."""
    return _argmin_open(in_system(state), state, params)


def jsq_tokens(key, obs, state, params):
    """Fewest estimated tokens in flight (`continuous.tokens_in_flight`), relative to the
    replica's KV capacity in tokens (a larger cache drains more tokens at once)."""
    prof = params.gpus
    cap = (prof.kv_blocks * prof.block_size).astype(jnp.float32)
    return _argmin_open(CB.tokens_in_flight(state.cluster) / cap, state, params)


def least_kv(key, obs, state, params):
    """Smallest fraction of KV blocks in use; ties broken by fewer requests."""
    frac = CB.kv_used(state.cluster, params.gpus) / params.gpus.kv_blocks
    return _argmin_open(frac + 1e-6 * in_system(state), state, params)


def vllm_dp_score(replicas) -> jax.Array:
    """vLLM's data-parallel load-balancing score of each replica, `4 * waiting + running`
    (waiting counts preempted requests too), `(R,)` int32.

    Source: vLLM 0.19.0 (commit 2a69949bd), `vllm/v1/engine/core_client.py`,
    `DPLBAsyncMPClient.get_core_engine_for_request`: `score = waiting * 4 + running`, the
    lowest wins with a strict `<` scanned from engine 0 (ties to the lowest index); the counts
    are `Scheduler.get_request_counts()` (`len(running)`, `len(waiting) +
    len(skipped_waiting)`, `vllm/v1/core/sched/scheduler.py`). vLLM's front end sees them as
    published by its DP coordinator, at most every 100 ms, plus one per request it routed since
    (`DPCoordinatorProc`'s `min_stats_update_interval_ms`); here they are exact at the
    arrival (docs/fidelity.md lists the difference)."""
    return 4 * replicas.queues.count + replicas.run.count


def vllm_dp_engine(replicas, profiles) -> jax.Array:
    """vLLM's internal data-parallel balancer as an engine-side router (`vllm_dp_score`, ties
    to the lowest index; it drops nothing, as vLLM's queues are unbounded): the replica of
    the request arriving now. For `evaluation.replay.replay_prefix(router=...)`."""
    return jnp.argmin(vllm_dp_score(replicas)).astype(jnp.int32)


def vllm_dp(key, obs, state, params):
    """vLLM's data-parallel load-balancing score (`vllm_dp_score`), the lowest wins; replicas
    that would drop the request are skipped as for every router here."""
    return _argmin_open(vllm_dp_score(state.cluster), state, params)


def make_sita_prompt(threshold: float = 512.0):
    """SITA by prompt length: prompts `<= threshold` tokens go to the replicas with the smaller
    KV caches, longer ones to the replicas with the largest (`kv_blocks * block_size` at least
    the median); within a group, fewest requests. With identical replicas both groups are all
    replicas (plain JSQ)."""

    def sita_prompt(key, obs, state, params):
        prof = params.gpus
        cap = (prof.kv_blocks * prof.block_size).astype(jnp.float32)
        big = cap >= jnp.median(cap)
        small = ~big | big.all()
        group = jnp.where(state.pending.prompt > threshold, big, small)
        ok = group & ~would_drop(state, params)
        use = jnp.where(ok.any(), ok, ~would_drop(state, params) | would_drop(state, params).all())
        return jnp.argmin(jnp.where(use, in_system(state), jnp.iinfo(jnp.int32).max)).astype(
            jnp.int32)

    return sita_prompt


sita_prompt = make_sita_prompt()


for _fn in (jsq_requests, jsq_tokens, least_kv, vllm_dp):
    register_function(_fn.__name__, KIND, _fn)


@register("sita_prompt", KIND, scenario_free=True)
def _sita_prompt_factory(env=None, params=None, threshold: float = 512.0):
    """SITA by prompt length (`make_sita_prompt`): prompts of at most `threshold` tokens to
    the smaller-cache replicas, longer ones to the largest; the default is `sita_prompt`."""
    fn = sita_prompt if float(threshold) == 512.0 else make_sita_prompt(float(threshold))
    return Policy(name="sita_prompt", kind=KIND, fn=fn, info={"threshold": float(threshold)})
