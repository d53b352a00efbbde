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

Registry: `get(name, **options)` builds a `Policy` (a callable with that signature, plus
`name`, `kind` and `info`); every factory accepts `env=` and `params=` (those that fit
something to the scenario — sita, tuned_static, smdp_optimal — need them). `names(kind)`
lists them; `register(name, kind)` adds one.

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
Prefix routing (`prefix_routing.py`, LLMPrefixRouting-v0, kind "prefix_routing"): the
production cache-aware routers of ../shared/ROUTERS.md at their published defaults:
llmd_scorers, dynamo_kv, sglang_cache_aware, aibrix_prefix_cache, session_affinity; and
the baseline most_cached (the plain cache-first rule, no production router's).
"""

from jaxserve.policies.registry import KINDS, Policy, get, kind_of, names, options, register
from jaxserve.policies import routing  # noqa: E402  (registers the routing policies)
from jaxserve.policies import batching  # noqa: E402  (registers the batching policies)
from jaxserve.policies import smdp  # noqa: E402  (registers smdp_optimal)
from jaxserve.policies import autoscaling  # noqa: E402 (registers the autoscalers)
from jaxserve.policies import prefix_routing  # noqa: E402 (registers the cache-aware routers)
from jaxserve.policies.batching import make_static
from jaxserve.policies.routing import SitaFit, fit_sita
from jaxserve.policies.smdp import SMDPModel, SMDPSolution, build_model, solve_smdp

__all__ = ["KINDS", "Policy", "SMDPModel", "SMDPSolution", "SitaFit", "batching",
           "build_model", "fit_sita", "get", "kind_of", "make_static", "names", "options",
           "register", "routing", "smdp", "solve_smdp"]
