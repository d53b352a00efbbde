"""How often other routing policies would act as a given one does, on its own trajectory.

A diagnostic for learned routers: which heuristic a policy behaves like, and where (by arrival
phase). `policy` routes the same request streams `evaluate` draws from `key` (the same
streams, environment keys and policy keys, so the trajectory is the one `evaluate` scores);
at every decision each reference policy is asked what it would do in that state, and its
answer is compared with the action taken. The references never act.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sources import check_not_tuning_key
from jaxserve.evaluation.episodes import as_action
from jaxserve.evaluation.evaluate import (asked_along_rollout, is_routing,
                                          make_streams_with_phase, switch_policy, trace_env)


@partial(jax.jit, static_argnames=("env_t", "policies", "references"))
def _agreements(env_t, policies, references, params, streams, keys, groups):
    """`(P, E, n, R)` bool: reference r's action is in the same group as policy p's at
    decision i of env e (one program: the acting policy selected by `lax.switch`, as
    `evaluate_many` does)."""
    return jax.vmap(lambda i: _agreements_of(env_t, switch_policy(policies, i), references,
                                             params, streams, keys, groups))(
        jnp.arange(len(policies)))


def _agreements_of(env_t, policy, references, params, streams, keys, groups):

    def one(stream, key):
        p = params.replace(trace=stream)

        def same(kp, obs, state, a):
            return jnp.stack([groups[as_action(r(kp, obs, state, p))] == groups[a]
                              for r in references])

        return asked_along_rollout(env_t, policy, p, key, same)

    return jax.vmap(one)(streams, keys)


def action_agreement(env, params, policies: Mapping[str, Callable],
                     references: Mapping[str, Callable], key, num_envs: int = 16,
                     num_steps: int = 1000, *, warmup: int = 0, groups=None) -> dict:
    """Share of each policy's routing decisions that each reference policy would have made too.

    Args:
      env, params: a Routing-v0 environment (synthetic arrivals) and its `ServingParams`.
      policies: `{name: policy}`, each acting on its own trajectory,
        `policy(key, obs, state, params) -> action`.
      references: `{name: policy}` asked at every decision, never acting.
      key: the evaluation key (as `evaluate`'s; a tuning key is refused).
      num_envs, num_steps: streams and requests per stream; warmup: first decisions of each
        stream left out.
      groups: optional group id per GPU (`(num_gpus,)` ints, e.g. speed tiers): two
        decisions agree when their GPUs are in the same group. Default: each GPU its own
        group (the same GPU). Where a rule picks a GPU inside a group by a detail (SITA: least
        work left within its size group), agreement by group says whether two policies send
        a request to the same kind of GPU.

    Returns:
      `{policy: {reference: {"all": share in [0, 1], "by_phase": [share per arrival phase
      (NaN where no measured request arrived in it)]}}}`; the phase is the arrival-process
      phase the routed request arrived in (for a bursty MMPP, phase 1 is the burst).
    """
    if not is_routing(env):
        raise ValueError("action_agreement compares routing decisions; got a batching env")
    check_not_tuning_key(key)
    if not policies or not references:
        raise ValueError("action_agreement needs at least one policy and one reference")
    if not 0 <= int(warmup) < int(num_steps):
        raise ValueError(f"warmup must be in [0, num_steps), got {warmup} and {num_steps}")
    num_gpus = int(env.num_actions)
    groups = np.arange(num_gpus) if groups is None else np.asarray(groups)
    if groups.shape != (num_gpus,) or not np.issubdtype(groups.dtype, np.integer):
        raise ValueError(f"groups must be {num_gpus} integers (one per GPU), got {groups!r}")
    streams, keys, phases = make_streams_with_phase(key, params, int(num_envs), int(num_steps),
                                                    None)
    n = streams.gap.shape[1]
    same = np.asarray(_agreements(trace_env(env, n), tuple(policies.values()),
                                  tuple(references.values()), params, streams, keys,
                                  jnp.asarray(groups, jnp.int32)))[:, :, int(warmup):]
    phases = np.asarray(phases)[:, int(warmup):]
    num_phases = int(np.asarray(params.arrivals.rates).shape[-1])
    out = {}
    for i, pname in enumerate(policies):
        out[pname] = {}
        for j, rname in enumerate(references):
            s = same[i, ..., j]
            by_phase = [float(s[phases == ph].mean()) if np.any(phases == ph)
                        else float("nan") for ph in range(num_phases)]
            out[pname][rname] = {"all": float(s.mean()), "by_phase": by_phase}
    return out
