"""Routers written once for every routing environment, reading the engine only through its
interface (`core.engines.Engine`, picked by `engine_of(state.cluster)`).

Routing-v0 (static batches, `core.cluster.Cluster`) and LLMRouting-v0 (continuous batching,
`core.continuous.Replicas`) share them: `random`, `round_robin` and `power_of_two` need only
the number of servers, the pending request's index and the requests each server holds;
`least_marginal` the engine's own load estimate (`Engine.marginal_backlog`) and which servers
would drop the request (`Engine.would_drop`). Signature of every jaxserve policy:
`policy(key, obs, state, params) -> int32 server index`.

Each is registered once, for both kinds "routing" (Routing-v0, the primary kind) and
"llm_routing" (LLMRouting-v0): `policies.get("least_marginal")` builds the Routing-v0 policy,
`policies.get("least_marginal", kind="llm_routing")` the same rule labelled for LLMRouting-v0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core.engines import engine_of
from jaxserve.policies.registry import register_function

# The kinds the rules here serve, the first (Routing-v0's) their primary kind.
KINDS = ("routing", "llm_routing")


def num_servers(state) -> int:
    """GPUs (Routing-v0) or replicas (LLM environments) of `state.cluster`; a Python int."""
    c = state.cluster
    return c.num_gpus if hasattr(c, "num_gpus") else c.num_replicas


def in_system(state) -> jax.Array:
    """Requests at each server, waiting plus running, `(num_servers,)` int32."""
    return engine_of(state.cluster).held(state.cluster)


def random_policy(key, obs, state, params):
    """Uniformly random server."""
    return jax.random.randint(key, (), 0, num_servers(state), dtype=jnp.int32)


def round_robin(key, obs, state, params):
    """Server `req_id mod N` of the pending request (its index in the episode or trace)."""
    return (state.pending.req_id % num_servers(state)).astype(jnp.int32)


def power_of_two(key, obs, state, params):
    """Two distinct servers drawn uniformly; the one with fewer requests (the first drawn on
    ties)."""
    n = num_servers(state)
    k1, k2 = jax.random.split(key)
    i = jax.random.randint(k1, (), 0, n, dtype=jnp.int32)
    j = (i + jax.random.randint(k2, (), 1, max(n, 2), dtype=jnp.int32)) % n
    count = in_system(state)
    return jnp.where(count[j] < count[i], j, i).astype(jnp.int32)


def least_marginal(key, obs, state, params):
    """Least expected added time-in-system: the server whose expected backlog grows least if
    the pending request joins it (`Engine.marginal_backlog`, from output estimates: the
    request's own expected latency there plus the delay it adds to the requests present),
    skipping servers that would drop it (`Engine.would_drop`) unless all would; ties to the
    lowest index. The greedy policy of both routing environments' reward-shaping potential:
    the server whose shaped step reward is largest, read off the state before the step."""
    c, req = state.cluster, state.pending
    engine = engine_of(c)
    cost = engine.marginal_backlog(c, params.gpus, req.prompt, req.estimate)
    bad = engine.would_drop(c, params.gpus, req)
    return jnp.argmin(jnp.where(bad & ~bad.all(), jnp.inf, cost)).astype(jnp.int32)


register_function("random", KINDS, random_policy)
register_function("round_robin", KINDS, round_robin)
register_function("power_of_two", KINDS, power_of_two)
register_function("least_marginal", KINDS, least_marginal)
