"""Does the minimal PureJaxRL-style PPO learn LLMPrefixRouting-v0? (its runs:
docs/prefix_caching.md, "Learnable by a standard PPO?" and the sections after it)

    python -m tests.prefix_learnability [--steps 262144] [--seed 0] \
        [--scenario sessions|system_prompts] [--network mlp|set] [--no-shaping] [--ranked]

Trains `tests/minimal_ppo.py` (PureJaxRL's CartPole-v1 settings, MLP on the flat observation,
no reward normalisation; `--network set`: `agents.ppo` with LLMRouting-v0's PPO settings and
the attention set network, which scores every replica with the same weights:
`agents.experiments.prefix_study.SET_PPO`, what experiment (p) trained until commit fa60d44) on
`make_llm_prefix_routing(scenario=...)` (prefix caching on, a 512-request synthetic
shared-prefix trace; `--no-shaping`: `shaping_gamma=None`; `--ranked`: PPO acts on the
ranked environment, `LLMRouting`'s "Ranked replicas") for `--steps` env steps, then
runs one episode
(the whole trace, the routing of `scripts/prefix_routers.py`) under the greedy PPO policy,
every production prefix router (kind "prefix_routing" but `most_cached`) and the load-only
baselines (these on the index-ordered environment: the dynamics are the same), and prints
each one's mean time in system per request (s), drops and token hit rate; with `--ranked`
also the constant policy "always rank 0" (most cached prefix, then least load). One trace
and one key: a learnability probe, not a confidence statement.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.agents.experiments.prefix_study import SET_PPO, train_ppo
from jaxserve.envs.llm_prefix_routing import (PREFIX_REQUESTS, PREFIX_SCENARIOS, PREFIX_SEED,
                                              make_llm_prefix_routing, prefix_workload)
from jaxserve.envs.llm_routing import DEFAULT_SHAPING_GAMMA
from jaxserve import policies as P
from tests.minimal_ppo import greedy_policy, make_train


def episode_metrics(env, params, policy, num_requests: int) -> dict[str, float]:
    """One episode of `num_requests` routing decisions from `env.reset(PRNGKey(0))` under
    `policy(key, obs, state, params)`: mean time in system per request (s), drops, token
    hit rate (hit / looked-up tokens at admissions)."""
    @jax.jit
    def run():
        obs, state = env.reset(jax.random.PRNGKey(0), params)

        def f(c, k):
            obs, state = c
            a = policy(k, obs, state, params)
            obs, state, _, _, info = env.step_env(k, state, a, params)
            return (obs, state), (info["in_system_time"], info["dropped"],
                                  info["prefix_hit_tokens"], info["prefix_lookup_tokens"])

        keys = jax.random.split(jax.random.PRNGKey(1), num_requests)
        return jax.tree.map(lambda x: x.sum(), jax.lax.scan(f, (obs, state), keys)[1])

    tis, dropped, hit, look = (float(np.asarray(x)) for x in run())
    return {"time_in_system_s": tis / num_requests, "dropped": dropped,
            "hit_rate": hit / max(look, 1.0)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=262_144, help="PPO training env steps")
    ap.add_argument("--seed", type=int, default=0, help="PPO's PRNG seed")
    ap.add_argument("--scenario", default="sessions", choices=sorted(PREFIX_SCENARIOS),
                    help="the synthetic workload (envs.llm_prefix_routing.PREFIX_SCENARIOS)")
    ap.add_argument("--network", default="mlp", choices=("mlp", "set"),
                    help="mlp: the minimal PureJaxRL PPO; set: agents.ppo, attention set net")
    ap.add_argument("--no-shaping", action="store_true", help="shaping_gamma=None")
    ap.add_argument("--ranked", action="store_true",
                    help="PPO on the ranked environment (actions and rows in rank order)")
    ap.add_argument("--eval-seeds", default="0",
                    help="comma-separated generator seeds of the evaluation traces (0 is the "
                         "training trace; others are traces PPO never saw)")
    args = ap.parse_args(argv)
    env, params = make_llm_prefix_routing(
        scenario=args.scenario, shaping_gamma=None if args.no_shaping else DEFAULT_SHAPING_GAMMA,
        ranked=bool(args.ranked))
    t0 = time.perf_counter()
    if args.network == "mlp":
        train, network = make_train({"TOTAL_TIMESTEPS": args.steps}, env, params)
        net_params, _ = jax.jit(train)(jax.random.PRNGKey(args.seed))
        jax.block_until_ready(net_params)
        learned = greedy_policy(network, net_params)
    else:
        learned = train_ppo(env, params, args.steps, [args.seed], **SET_PPO)[0][0]
    print(f"trained {args.steps:,} steps (seed {args.seed}, {args.network}, scenario "
          f"{args.scenario}, shaping {'off' if args.no_shaping else 'on'}"
          f"{', ranked' if args.ranked else ''}) in {time.perf_counter() - t0:.0f} s",
          flush=True)
    # Policies acting on the ranked environment (PPO's actions are ranks); the routers name
    # replicas and act on the index-ordered one.
    on_ranked = {"ppo (greedy)": learned}
    if args.ranked:
        on_ranked["always rank 0"] = lambda key, obs, state, params: jnp.int32(0)
    pols = {**on_ranked,
            **{n: P.get(n, kind="prefix_routing").fn for n in P.names("prefix_routing")
               if n != "most_cached"},
            **{n: P.get(n, kind="llm_routing").fn for n in (
                "jsq_requests", "jsq_tokens", "round_robin", "least_marginal")}}
    for seed in (int(x) for x in args.eval_seeds.split(",")):
        trace = prefix_workload(PREFIX_REQUESTS, seed, scenario=args.scenario)
        env_e, params_e = make_llm_prefix_routing(
            trace=trace, shaping_gamma=None if args.no_shaping else DEFAULT_SHAPING_GAMMA,
            ranked=False)
        n = int(params_e.max_steps_in_episode)  # the whole trace
        print(f"evaluation trace: generator seed {seed}"
              + (" (the training trace)" if seed == PREFIX_SEED else " (not seen in training)"))
        env_r = env_e.replace_static(ranked=args.ranked)
        for name, pol in pols.items():
            m = episode_metrics(env_r if name in on_ranked else env_e, params_e, pol, n)
            print(f"  {name:22s} mean time in system {m['time_in_system_s']:7.2f} s  drops "
                  f"{m['dropped']:4.0f}  token hit rate {m['hit_rate']:.3f}", flush=True)


if __name__ == "__main__":
    main()
