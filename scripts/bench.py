"""Throughput benchmark: env-steps/s of the jaxserve environments under jit(vmap(lax.scan)).

Measures, with random actions and observations consumed inside the scan (XLA would otherwise
drop the observation work):
  - env-steps/s at several env counts, compile time reported apart from run time;
  - state bytes per env, and the memory-bandwidth bound 2 x state bytes per step against a
    measured copy bandwidth;
  - gymnax's Breakout-MinAtar at the same harness and env count, as a ratio;
  - the pure-Python reference simulator (tests/reference_sim.py) on the same Routing workload
    (same GPUs, arrival rate and sizes, random routing), as a ratio;
  - optionally PPO training steps/s on Routing-v0 and CartPole-v1 (`--ppo`).

Usage:
  python scripts/bench.py                      # full run (a few minutes on 2 CPU cores)
  python scripts/bench.py --quick              # small sizes, for a smoke test
  python scripts/bench.py --out docs/bench.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gymnax  # noqa: E402

import jaxserve  # noqa: E402
from jaxserve.core.types import GPUProfile  # noqa: E402


def routing_env():
    gpus = [GPUProfile(c0=0.02, alpha=5e-5, beta=0.012, gamma=2e-4, max_batch=8, queue_cap=64,
                       name="fast")] * 4 + [
        GPUProfile(c0=0.03, alpha=1.2e-4, beta=0.025, gamma=4e-4, max_batch=8, queue_cap=64,
                   name="slow")] * 4
    return jaxserve.make("Routing-v0", gpus=gpus, arrival_rate=12.0)


def make_runner(env, params, num_envs, num_steps):
    """jit(vmap(scan)) of random-action steps; returns a function of a key."""

    def one_env(key):
        obs, state = env.reset(key, params)

        def step(carry, k):
            state, acc = carry
            k_a, k_s = jax.random.split(k)
            a = env.action_space(params).sample(k_a)
            obs, state, r, term, trunc, _ = env.step(k_s, state, a, params)
            return (state, acc + obs.sum() + r), None

        (state, acc), _ = jax.lax.scan(step, (state, jnp.float32(0.0)),
                                       jax.random.split(key, num_steps))
        return acc

    return jax.jit(jax.vmap(one_env)), jax.random.split(jax.random.PRNGKey(0), num_envs)


def time_env(env, params, num_envs, num_steps, repeats=3):
    fn, keys = make_runner(env, params, num_envs, num_steps)
    t0 = time.perf_counter()
    compiled = fn.lower(keys).compile()
    compile_s = time.perf_counter() - t0
    compiled(keys).block_until_ready()  # warm-up
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled(keys).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return {"num_envs": num_envs, "num_steps": num_steps, "compile_s": compile_s,
            "run_s": best, "steps_per_s": num_envs * num_steps / best}


def state_bytes(env, params):
    _, state = env.reset(jax.random.PRNGKey(0), params)
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(state)))


def copy_bandwidth_gbs():
    """Sustained read+write bandwidth of a large jitted copy (GB/s, bytes read + written)."""
    x = jnp.ones((64 * 1024 * 1024 // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)
    f(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        x = f(x)
    x.block_until_ready()
    return 10 * 2 * x.nbytes / (time.perf_counter() - t0) / 1e9


def reference_requests_per_s(n):
    from tests import reference_sim as ref
    env, params = routing_env()
    rng = np.random.default_rng(0)
    arrival = np.cumsum(rng.exponential(1 / 12.0, size=n))
    prompt = np.where(rng.random(n) < 0.2, 1024, 256)
    output = np.where(prompt > 256, 512, 32)
    gpu = rng.integers(0, env.num_gpus, size=n)
    profiles = [{k: float(np.asarray(getattr(params.gpus, k))[g]) for k in ref.PROFILE_KEYS}
                for g in range(env.num_gpus)]
    t0 = time.perf_counter()
    ref.simulate(arrival, prompt, output, gpu, profiles)
    return n / (time.perf_counter() - t0)


def ppo_steps_per_s(env_name, num_envs, total_steps):
    import agents
    t0 = time.perf_counter()
    out = agents.train(env_name, {}, "ppo", total_steps=total_steps, seed=0, num_envs=num_envs,
                       progress=False)
    wall = time.perf_counter() - t0
    return {"env": env_name, "num_envs": num_envs, "total_steps": total_steps,
            "wall_s_incl_compile": wall, "steps_per_s_incl_compile": total_steps / wall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--num-envs", default=None, help="comma-separated env counts")
    ap.add_argument("--num-steps", type=int, default=None, help="scan length per env")
    ap.add_argument("--ppo", action="store_true", help="also time PPO training")
    ap.add_argument("--ppo-steps", type=int, default=None,
                    help="PPO steps per environment (default 1M; 20k with --quick)")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args(argv)
    counts = ([1, 256] if args.quick else [1, 256, 4096, 16384]) if args.num_envs is None \
        else [int(x) for x in args.num_envs.split(",")]
    steps = args.num_steps or (20 if args.quick else 100)
    # The env count of the cross-environment comparisons: the largest one measured.
    big = (256 if args.quick else 4096) if args.num_envs is None else max(counts)

    res = {"device": str(jax.devices()[0]), "backend": jax.default_backend(),
           "jax": jax.__version__, "machine": platform.machine(), "results": {}}
    envs = {"Routing-v0 (8 GPUs, queue 64)": routing_env(),
            "Batching-v0": jaxserve.make("Batching-v0"),
            # One step is a 15 s control interval (~18 arrivals at the default diurnal load).
            "Autoscaling-v0 (8 replicas)": jaxserve.make("Autoscaling-v0")}
    for name, (env, params) in envs.items():
        rows = []
        for n in counts:
            r = time_env(env, params, n, steps)
            rows.append(r)
            print(f"{name:30s} envs={n:6d}  compile {r['compile_s']:6.1f}s  "
                  f"{r['steps_per_s']:12,.0f} env-steps/s", flush=True)
        res["results"][name] = {"state_bytes": state_bytes(env, params), "rows": rows}

    brk, brk_params = gymnax.make("Breakout-MinAtar")
    r = time_env(brk, brk_params, big, steps)
    res["results"]["Breakout-MinAtar"] = {"state_bytes": state_bytes(brk, brk_params),
                                          "rows": [r]}
    print(f"{'Breakout-MinAtar':30s} envs={big:6d}  compile {r['compile_s']:6.1f}s  "
          f"{r['steps_per_s']:12,.0f} env-steps/s", flush=True)

    ref_rate = reference_requests_per_s(20_000 if args.quick else 200_000)
    res["reference_python_requests_per_s"] = ref_rate
    bw = copy_bandwidth_gbs()
    res["copy_bandwidth_gbs"] = bw

    routing_name = next(iter(envs))
    rrow = next(r for r in res["results"][routing_name]["rows"] if r["num_envs"] == big)
    sb = res["results"][routing_name]["state_bytes"]
    bound = bw * 1e9 / (2 * sb)
    summary = {
        "routing_vs_breakout": rrow["steps_per_s"] / r["steps_per_s"],
        "routing_vs_reference_python": rrow["steps_per_s"] / ref_rate,
        "routing_state_bytes": sb,
        "routing_bandwidth_bound_steps_per_s": bound,
        "routing_fraction_of_bandwidth_bound": rrow["steps_per_s"] / bound,
    }
    if args.ppo:
        tot = args.ppo_steps or (20_000 if args.quick else 1_000_000)
        res["ppo"] = [ppo_steps_per_s("Routing-v0", big // 4, tot),
                      ppo_steps_per_s("CartPole-v1", big // 4, tot)]
        for p in res["ppo"]:
            print(f"PPO {p['env']:12s} envs={p['num_envs']}  "
                  f"{p['steps_per_s_incl_compile']:,.0f} steps/s incl. compile", flush=True)
    res["summary"] = summary
    print(f"\nreference (pure Python): {ref_rate:,.0f} requests/s;  copy bandwidth {bw:.1f} GB/s")
    print(f"Routing-v0 at {big} envs: {summary['routing_vs_breakout']:.2f}x Breakout-MinAtar, "
          f"{summary['routing_vs_reference_python']:.1f}x the Python reference; state "
          f"{sb:,} B/env -> bandwidth bound {bound:,.0f} steps/s "
          f"({summary['routing_fraction_of_bandwidth_bound']:.1%} of it)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
