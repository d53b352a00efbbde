"""Routers of LLMDisaggRouting-v0 (prefill/decode disaggregation), kind "disagg_routing".

Each is `policy(key, obs, state, params) -> int32 action` (the environment's flattened action,
`envs.llm_disagg_routing.encode_action`), built the way the production systems route
(docs/disaggregation.md section 4): the D replica first, by a per-pool rule; then the
decider, knowing that D replica; then, if it disaggregates, the P replica by the same
per-pool rule. They read only what section 4 lets a router see: the arriving request's
prompt tokens and `disaggregation.replica_views` (running, waiting, KV usage per replica);
never output lengths, never the link.

Per-pool rules (ties to the lowest index, `argmin`):
* `jsq`: fewest requests, `running + waiting` (waiting includes pending and remote D
  requests, as vLLM's `num_waiting_reqs`);
* `least_kv`: smallest KV usage (blocks in use, held for sends and reserved, over
  `kv_blocks`), ties broken by fewer requests.

Deciders (docs/disaggregation.md section 14, at their published defaults; with no prefix
cache here the non-cached tokens are the whole prompt):
* `llmd`: llm-d's `prefix-based-pd-decider`, disaggregate iff `prompt >= 16`
  (`nonCachedTokens: 16` of the shipped `deploy/config/pd-epp-config.yaml`; `>=` as in its
  `disaggregate`);
* `dynamo`: Dynamo's disaggregated router, remote prefill iff `prompt > 1000`
  (`max_local_prefill_length` of `DisaggRouterConf::default`; `>` as in `prefill_remote`);
* `always`, `never` (BLIS's `always` / `never` deciders; `never` is the colocated cluster on
  the D pool alone).

Registered names: `{decider}_{rule}` for each decider and rule (`llmd_jsq`,
`llmd_least_kv`, `dynamo_jsq`, `dynamo_least_kv`, `always_jsq`, `always_least_kv`,
`never_jsq`, `never_least_kv`), each once, and `disagg_round_robin` (vLLM's toy P/D proxy:
P and D each round-robin, always disaggregating; named apart from the generic `round_robin`
of the other routing kinds so that `get("round_robin")` stays unambiguous). With an empty P pool
every decider answers "not disaggregated".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core import disaggregation as PD
from jaxserve.policies.registry import register_function

KIND = "disagg_routing"
LLMD_NON_CACHED_TOKENS = 16  # llm-d deploy/config/pd-epp-config.yaml (section 14)
DYNAMO_MAX_LOCAL_PREFILL_LENGTH = 1000  # Dynamo DisaggRouterConf::default (section 14)


def _views(state, params) -> dict:
    return PD.replica_views(state.cluster, params.gpus)


def jsq_cost(views) -> jax.Array:
    """`(R,)` requests on each replica, `running + waiting`. float32."""
    return (views["running"] + views["waiting"]).astype(jnp.float32)


def least_kv_cost(views) -> jax.Array:
    """`(R,)` KV usage, ties broken by fewer requests. float32."""
    return views["kv_usage"] + 1e-6 * jsq_cost(views)


RULES = {"jsq": jsq_cost, "least_kv": least_kv_cost}


def llmd_decider(prompt) -> jax.Array:
    """llm-d's P/D decider at its shipped threshold: disaggregate iff prompt >= 16 tokens."""
    return prompt >= LLMD_NON_CACHED_TOKENS


def dynamo_decider(prompt) -> jax.Array:
    """Dynamo's disaggregated router at its default: remote prefill iff prompt > 1000."""
    return prompt > DYNAMO_MAX_LOCAL_PREFILL_LENGTH


DECIDERS = {"llmd": llmd_decider, "dynamo": dynamo_decider,
            "always": lambda prompt: jnp.bool_(True),
            "never": lambda prompt: jnp.bool_(False)}


def route(state, params, decider, rule) -> jax.Array:
    """The action of `decider` with per-pool `rule`: D replica by `rule` among D rows, then
    the decider on the prompt, then the P replica by `rule` among P rows. int32 action."""
    views = _views(state, params)
    is_p = views["is_prefill"]
    num_p = is_p.sum().astype(jnp.int32)
    cost = rule(views)
    inf = jnp.float32(jnp.inf)
    d = (jnp.argmin(jnp.where(is_p, inf, cost)) - num_p).astype(jnp.int32)
    p = jnp.argmin(jnp.where(is_p, cost, inf)).astype(jnp.int32)
    dis = decider(state.pending.prompt) & (num_p > 0)
    p = jnp.where(dis, p, -1)
    # num_prefill is static in the environment; recover it from the mask's length.
    return (d * (num_p + 1) + p + 1).astype(jnp.int32)


def _make(decider_name: str, rule_name: str):
    decider, rule = DECIDERS[decider_name], RULES[rule_name]

    def policy(key, obs, state, params):
        return route(state, params, decider, rule)

    policy.__name__ = f"{decider_name}_{rule_name}"
    policy.__doc__ = (f"Decider `{decider_name}` (`{decider.__name__}`), D then P replica by "
                      f"`{rule_name}` within each pool.")
    return policy


for _d in DECIDERS:
    for _r in RULES:
        register_function(f"{_d}_{_r}", KIND, _make(_d, _r))


def round_robin(key, obs, state, params):
    """vLLM's toy P/D proxy: P and D replicas each in turn (by decision index,
    `state.time`), always disaggregating (section 14; with an empty P pool, D in turn)."""
    is_p = state.cluster.is_prefill
    num_p = is_p.sum().astype(jnp.int32)
    num_d = is_p.shape[0] - num_p
    d = (state.time % num_d).astype(jnp.int32)
    p = jnp.where(num_p > 0, state.time % jnp.maximum(num_p, 1), -1).astype(jnp.int32)
    return (d * (num_p + 1) + p + 1).astype(jnp.int32)


register_function("disagg_round_robin", KIND, round_robin)
