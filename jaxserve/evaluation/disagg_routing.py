"""Drained episodes of LLMDisaggRouting-v0 under several policies on common random numbers.

`drained_latencies` routes `num_requests` fresh requests per stream with each policy (the same
environment keys per step, so every policy sees the same arrivals and tokens: the request
stream is drawn from the step keys only), then drains the cluster, and reports each
policy's drop-inclusive mean end-to-end latency per stream. One compiled program serves
every policy. Used by tests/test_llm_disagg_routing.py and the learnability measurement;
`python -m jaxserve.evaluation.disagg_routing --rates 5 7` prints the registered routers'
drained latencies at those arrival rates (docs/envs/llm_disagg_routing.md).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import policies as P
from jaxserve.core import arrivals as A
from jaxserve.envs.llm_disagg_routing import drain, make_llm_disagg_routing


def episode(env, params, policy, key, num_requests: int):
    """Routes `num_requests` requests from reset with `policy` (no truncation, no
    auto-reset), then drains. Returns `(log, dropped (N,) bool, actions (N,) int32, info sums)`
    with `N = num_requests` (<= `env.num_requests`)."""
    k_reset, k_steps, k_pol = jax.random.split(key, 3)
    obs, st = env.reset_env(k_reset, params)

    def body(c, i):
        obs, st = c
        a = policy(jax.random.fold_in(k_pol, i), obs, st, params)
        obs, st, _, _, info = env.step_env(jax.random.fold_in(k_steps, i), st, a, params)
        return (obs, st), (info["dropped"] > 0, a, info)

    (obs, st), (dropped, acts, info) = jax.lax.scan(body, (obs, st),
                                                    jnp.arange(num_requests))
    sums = {k: v.sum() for k, v in info.items()}
    return drain(env, st, params), dropped, acts, sums


def drained_latencies(env, params, policies: dict, keys, num_requests: int):
    """`(len(policies), len(keys))` drop-inclusive mean end-to-end latency (s): (sum of the
    served requests' E2E + drop_penalty_s * drops) / num_requests, per policy and stream.
    A request left unfinished after the drain (a replica stalled for good) counts as a
    drop. Every policy's action is computed at every step and the run's own selected (the
    policies are cheap; the engine, compiled once, is not). Runs one after another
    (`lax.map`): a vmapped event loop runs every lane until the slowest is done, which on
    CPU costs more than it saves."""
    fns = list(policies.values())

    def one(j, key):
        def pol(k, obs, st, prm):
            return jnp.stack([jnp.asarray(f(k, obs, st, prm), jnp.int32) for f in fns])[j]
        log, dropped, _, _ = episode(env, params, pol, key, num_requests)
        e2e = log.requests.e2e[:num_requests]
        lost = dropped | ~jnp.isfinite(e2e)
        return jnp.where(lost, params.drop_penalty_s, e2e).sum() / num_requests

    js = jnp.repeat(jnp.arange(len(fns)), keys.shape[0])
    ks = jnp.tile(keys, (len(fns), 1))
    return jax.lax.map(lambda a: one(*a), (js, ks)).reshape(len(fns), keys.shape[0])


def main(argv=None):
    """`python -m jaxserve.evaluation.disagg_routing [--rates R ...] [--streams S]
    [--requests N] [--seed K]`: every registered "disagg_routing" router on the default
    scenario at each rate (req/s), `S` drained streams of `N` requests; prints the mean
    drop-inclusive E2E latency (s) over streams."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", type=float, nargs="+", default=[5.0])
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args(argv)
    env, params = make_llm_disagg_routing()
    names = P.names("disagg_routing")
    pols = {n: P.get(n, kind="disagg_routing") for n in names}
    run = jax.jit(lambda prm, keys: drained_latencies(env, prm, pols, keys, a.requests))
    keys = jax.random.split(jax.random.PRNGKey(a.seed), a.streams)
    for rate in a.rates:
        t = time.perf_counter()
        res = np.asarray(run(params.replace(arrivals=A.poisson(rate)), keys))
        print(f"rate {rate:g} req/s ({time.perf_counter() - t:.0f} s):")
        for j in np.argsort(res.mean(1)):
            print(f"  {names[j]:20s} {res[j].mean():8.2f} s")


if __name__ == "__main__":
    main()
