"""The production cache-aware routers (and the `most_cached` and five load-only baselines) on
LLMPrefixRouting-v0.

Each router routes one episode of a named workload (`--scenario`, default "sessions": the
whole 512-request synthetic trace, drained at its end); all routers run as lanes of one vmapped program (`lax.switch`
over the router index). Reported per router: mean time in system per request (s, the
episode's integral of requests present over the trace's requests), mean time to first
token (s), drops, preemptions, prefix token hit rate (hit / looked-up tokens at
admissions, readmissions after a preemption included) and evictions. (Not the episode's
return: its potential-based shaping does not telescope in an undiscounted sum.)

One trace and one key: differences between routers are of this stream, not a confidence
statement. Usage (from the repository root):
  python -m jaxserve.scripts.prefix_routers [--requests 512] [--seed 0] [--scenario system_prompts]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.envs.llm_prefix_routing import (PREFIX_SCENARIOS, make_llm_prefix_routing,
                                              prefix_workload)
from jaxserve import policies as P


def main(argv=None):

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512, help="trace requests (one episode)")
    ap.add_argument("--seed", type=int, default=0, help="the trace generator's seed")
    ap.add_argument("--scenario", default="sessions", choices=sorted(PREFIX_SCENARIOS),
                    help="the synthetic workload (envs.llm_prefix_routing.PREFIX_SCENARIOS)")
    args = ap.parse_args(argv)
    env, params = make_llm_prefix_routing(  # index order: the routers name replicas
        trace=prefix_workload(args.requests, args.seed, scenario=args.scenario), ranked=False)
    # Every cache-aware router (kind "prefix_routing"), then some load-only LLM routers.
    pols = {n: P.get(n, kind="prefix_routing").fn for n in P.names("prefix_routing")}
    pols.update({n: P.get(n, kind="llm_routing").fn for n in (
        "jsq_requests", "jsq_tokens", "least_kv", "least_marginal", "round_robin")})
    names, fns = list(pols), list(pols.values())
    n = args.requests

    def episode(idx):
        obs, state = env.reset(jax.random.PRNGKey(0), params)

        def f(c, k):
            obs, state = c
            a = jax.lax.switch(idx, [lambda o, s, p=p: p(k, o, s, params) for p in fns],
                               obs, state)
            obs, state, _, _, info = env.step_env(k, state, a, params)
            keep = {k2: info[k2] for k2 in ("in_system_time", "ttft_sum", "first_tokens",
                                             "dropped", "preemptions", "prefix_hit_tokens",
                                             "prefix_lookup_tokens", "prefix_evictions")}
            return (obs, state), keep

        _, info = jax.lax.scan(f, (obs, state), jax.random.split(jax.random.PRNGKey(1), n))
        return jax.tree.map(lambda x: x.sum(), info)

    t0 = time.perf_counter()
    tot = jax.jit(jax.vmap(episode))(jnp.arange(len(fns)))
    tot = {k: np.asarray(v, np.float64) for k, v in tot.items()}
    print(f"LLMPrefixRouting-v0, scenario {args.scenario}, {n} requests, seed {args.seed}; "
          f"{time.perf_counter() - t0:.0f} s "
          f"(compile + run), load average {os.getloadavg()[0]:.1f}")
    print(f"{'router':20s} {'mean TIS s':>10s} {'mean TTFT s':>11s} {'drops':>6s} "
          f"{'preempt':>7s} {'hit rate':>8s} {'evictions':>9s}")
    for i, name in enumerate(names):
        ttft = tot["ttft_sum"][i] / max(tot["first_tokens"][i], 1.0)
        hit = tot["prefix_hit_tokens"][i] / max(tot["prefix_lookup_tokens"][i], 1.0)
        print(f"{name:20s} {tot['in_system_time'][i] / n:10.2f} {ttft:11.2f} "
              f"{int(tot['dropped'][i]):6d} {int(tot['preemptions'][i]):7d} {hit:8.3f} "
              f"{int(tot['prefix_evictions'][i]):9d}")


if __name__ == "__main__":
    main()
