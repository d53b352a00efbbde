"""Policies: routing heuristics, static and SMDP-optimal batchers, one shared signature.

Signature (heuristics and learned agents alike)::

    policy(key, obs, state, params) -> action

for ONE environment (the harness vmaps it): `key` a PRNG key for this decision, `obs` the
environment's observation, `state` its state pytree (`RoutingState` / `BatchingState`),
`params` its `ServingParams`; `action` an int32 scalar (Routing-v0: a GPU index, Batching-v0:
0 = wait or k = dispatch k). Pure JAX, jit- and vmap-safe. A learned agent usually reads only
`obs`; heuristics read `state`, but only what a real scheduler knows: prompt lengths, output
*estimates*, queue contents and running batches — never the true output lengths
(`pending.output`, `queues.output`) and never the future (`BatchingState.upcoming`).

Registry (`registry.py`): policies are registered under a (kind, name) pair, the kind being
the environment family they act in (`KINDS`: "routing" Routing-v0, "batching",
"autoscaling", "prefix_routing" LLMPrefixRouting-v0, "llm_routing" LLMRouting-v0). A name is
unique within its kind; `sita_prompt` names different policies of kinds "routing" and
"llm_routing". A rule shared by environments (random, round_robin, power_of_two,
least_marginal: `generic.py`, which reads each engine through `core.engines`) is registered
once for both routing kinds. `get(name, kind=None, **options)`
builds a `Policy` (a callable with that signature, plus `name`, `kind` — the kind it was got
for — and `info`); without `kind=` the name must be unambiguous (ValueError naming the kinds
otherwise). Every factory accepts `env=` and `params=` (those that fit something to the
scenario — sita, tuned_static, smdp_optimal — need them). `names(kind)` lists the names,
`kinds_of(name)` the kinds holding one, `options(name, kind)` a factory's options;
`register(name, kind)` adds a factory (`kind` a kind or a tuple of kinds),
`register_function(name, kind, fn)` a fixed function.

Routing (`routing.py`): random, round_robin, weighted_round_robin, jsq, least_work_left, sed,
power_of_two, least_marginal (the greedy policy of the shaping potential), join_idle_queue,
sita (+ `fit_sita`), sita_prompt and sita_predicted (SITA on a
predicted output length), sita_tuned (registered by `jaxserve.evaluation.tuning`: SITA's
orientation and a spill threshold chosen by simulation); and two ORACLES given true output
lengths, sed_oracle and least_work_left_oracle (references, not realisable baselines).
Fitted or tuned policies (sita*, tuned_static, smdp_optimal) draw their samples with a tuning
key (`core.sources.tuning_key`), which evaluation refuses.
Batching (`batching.py`, `smdp.py`): static, greedy, tuned_static (registered by
`jaxserve.evaluation.tuning`, whose `tune_static` simulates the grid),
smdp_optimal (+ `solve_smdp`).
Autoscaling (`autoscaling.py`, Autoscaling-v0): fixed, hpa (Kubernetes HPA on utilisation),
knative (Knative KPA on concurrency, stable/panic windows), ray_serve (Ray Serve's ongoing-
requests rule with up/down delays); stateless, their windows recomputed from the env state's
`history`.
LLM routing (`llm_routing.py`, LLMRouting-v0, kind "llm_routing"): random, round_robin,
power_of_two, jsq_requests, jsq_tokens, least_kv, vllm_dp (vLLM's data-parallel balancer),
sita_prompt (a fixed prompt-length threshold, option `threshold`) and least_marginal (the
greedy policy of LLMRouting-v0's shaping potential).
Prefix routing (`prefix_routing.py`, LLMPrefixRouting-v0, kind "prefix_routing"): the
production cache-aware routers of ../shared/ROUTERS.md at their published defaults:
llmd_scorers, dynamo_kv, sglang_cache_aware, aibrix_prefix_cache, session_affinity; and
the baseline most_cached (the plain cache-first rule, no production router's).
Disaggregated routing (`disagg_routing.py`, LLMDisaggRouting-v0, kind "disagg_routing"):
llm-d's P/D decider and Dynamo's disaggregated router at their published defaults, always
and never disaggregate, each with JSQ or least-KV within each pool (`llmd_jsq`, ...), and
vLLM's toy proxy (`disagg_round_robin`).
"""

from jaxserve.policies.registry import (KINDS, Policy, get, kind_of, kinds_of, names, options,
                                       register, register_function)
from jaxserve.policies import routing  # noqa: E402  (registers the routing policies)
from jaxserve.policies import batching  # noqa: E402  (registers the batching policies)
from jaxserve.policies import smdp  # noqa: E402  (registers smdp_optimal)
from jaxserve.policies import autoscaling  # noqa: E402 (registers the autoscalers)
from jaxserve.policies import llm_routing  # noqa: E402 (registers LLMRouting-v0's routers)
from jaxserve.policies import prefix_routing  # noqa: E402 (registers the cache-aware routers)
from jaxserve.policies import disagg_routing  # noqa: E402 (registers LLMDisaggRouting-v0's)
from jaxserve.policies.batching import make_static
from jaxserve.policies.routing import SitaFit, fit_sita
from jaxserve.policies.smdp import SMDPModel, SMDPSolution, build_model, solve_smdp

__all__ = ["KINDS", "Policy", "SMDPModel", "SMDPSolution", "SitaFit", "batching",
           "build_model", "fit_sita", "get", "kind_of", "kinds_of", "llm_routing",
           "make_static", "names", "options", "register", "register_function", "routing",
           "smdp", "solve_smdp"]
