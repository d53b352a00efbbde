"""Throughput benchmark of the jaxserve environments under jit(vmap(lax.scan)), in one run.

For every environment and env count it reports, with random actions and every step's
observation and reward consumed inside the scan (XLA would otherwise drop that work):
  - compile time (`lower().compile()`), apart from run time;
  - env-steps/s **from reset** (the scan starts at freshly reset states: empty queues) and
    **warmed up** (it starts where `--warmup` earlier steps left the same environments);
  - the ratio to gymnax's Breakout-MinAtar measured by the same harness, env count and run;
  - requests/s (arrivals handled per second, `info["arrived"]`) against the pure-Python
    reference (`jaxserve/reference/sim.py`) on the same workload: the same GPUs, arrival rate
    and token law, random decisions;
  - state bytes per environment.
Routing-v0 also runs on the dense batched engine path (`lanes.batched_path`, the GPU
default) so both paths are compared on the same backend. `--ppo` adds PPO training steps/s on
Routing-v0 (with its registered training defaults, and with CartPole-v1's exact PPO settings)
against the same PureJaxRL-style PPO on CartPole-v1 at equal env count.

The harness (`time_env`, `NoOpEnv`, the trace analysis) is `jaxserve.evaluation.benchmark`;
this script holds the benchmark's workloads and modes.

Usage (from the repository root; docs/benchmarks.md has the figures):
  python -m jaxserve.scripts.bench --num-steps 50 --warmup 150 --repeats 3 --ppo --ppo-envs 256 \
      --ppo-steps 262144 --out lab/bench/bench_cpu.json      # the acceptance run (2-core CPU: ~2 min)
  python -m jaxserve.scripts.bench --quick                       # small sizes, a smoke test
  python -m jaxserve.scripts.bench --num-envs 16384,65536,262144 --ppo   # on a GPU
  python -m jaxserve.scripts.bench --profile --num-envs 256,4096  # Routing-v0 step variants
  python -m jaxserve.scripts.bench --profile --profile-env LLMRouting-v0 --num-envs 256 --num-steps 20 \
      --warmup 40 --repeats 2     # LLMRouting-v0: decode runs on/off, no engine, boundaries
  python -m jaxserve.scripts.bench --trace --num-envs 256,4096    # Routing-v0 per-XLA-op trace
  python -m jaxserve.scripts.bench --curve 10 --only "LLMRouting-v0 (4" --num-envs 256 --num-steps 128
      # PPO's layout from reset to the steady state, 128-step chunks
  python -m jaxserve.scripts.bench --trace --trace-env LLMPrefixRouting-v0 --num-envs 256 --num-steps 8
  python -m jaxserve.scripts.bench --trace --trace-env LLMRouting-v0 --num-envs 256 --num-steps 32 \
      --warmup 960     # at the steady state, with the engine's phases (named scopes)
  python -m jaxserve.scripts.bench --prefix --num-envs 256,4096 --num-steps 32 --repeats 2
      # continuous engine with/without prefix caching (evaluation.replay_prefix_arrays)
  python -m jaxserve.scripts.bench --prefix-env --num-envs 256 --num-steps 16 --repeats 2
      # LLMPrefixRouting-v0's default scenario, caching on and off (same process)
  python -m jaxserve.scripts.bench --ab decode_runs=True,False --curve 12 \
      --only "LLMRouting-v0 (4" --num-envs 256 --num-steps 128
      # a paired A/B of an engine field (core/engines.py): both programs in one process,
      # chunks alternated
  python -m jaxserve.scripts.bench --ceiling --curve 12 --num-envs 256 --num-steps 128
      # LLMRouting-v0's engine against one boundary pass per step and against no engine
  python -m jaxserve.scripts.bench --slots 32,16 --curve 12 --num-envs 256 --num-steps 128
      # LLMRouting-v0 with fewer running slots (replicas' max_seqs): speed, and what it changes
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gymnax
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import agents
import jaxserve
from jaxserve.agents.config import PPOConfig
from jaxserve.agents.defaults import ENV_DEFAULTS
from jaxserve.core import arrivals as A
from jaxserve.core import cluster as C
from jaxserve.core import continuous as CB
from jaxserve.core import engines
from jaxserve.core import lanes
from jaxserve.core.replica import ReplicaProfile, replica_profile, stack_replicas
from jaxserve.core.sources import sample_tokens_n
from jaxserve.core.types import GPUProfile
from jaxserve.envs import routing as R
from jaxserve.envs.llm_routing import llm_routing_replicas
from jaxserve.evaluation.benchmark import (NoOpEnv, aggregate_trace, best_seconds, hlo_op_summary,
                                           make_runner, paired_curve, phase_summary,
                                           rollout_curve, rollout_tally, state_bytes,
                                           time_env)
from jaxserve.evaluation.replay import replay_prefix_arrays
from jaxserve.reference import sim as ref
from jaxserve.traces.prefix import build_prefix_tree

ROUTING = "Routing-v0 (8 GPUs, queue 64)"
ROUTING_DENSE = "Routing-v0 (8 GPUs, queue 64), dense path"
BREAKOUT = "Breakout-MinAtar"


def routing_env():
    """The benchmark's Routing-v0 workload: 4 fast and 4 slow GPUs, queues of 64, 12 requests/s."""
    gpus = [GPUProfile(c0=0.02, alpha=5e-5, beta=0.012, gamma=2e-4, max_batch=8, queue_cap=64,
                       name="fast")] * 4 + [
        GPUProfile(c0=0.03, alpha=1.2e-4, beta=0.025, gamma=4e-4, max_batch=8, queue_cap=64,
                   name="slow")] * 4
    return jaxserve.make("Routing-v0", gpus=gpus, arrival_rate=12.0)


def _cpu_description() -> dict:
    """The CPU's model name and cache sizes (Linux; empty elsewhere). The engine's step is
    bound by gathers and scatters into a state of ~9 KB per environment (36 MB at 4,096), so
    whether it fits in the last-level cache moves the figures between machines."""
    out = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "cache size") and key.strip() not in out:
                out[key.strip()] = value.strip()
        for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            level, kind = (idx / "level").read_text().strip(), (idx / "type").read_text().strip()
            out[f"L{level} {kind}"] = (idx / "size").read_text().strip()
    except OSError:
        pass
    return out


def _profiles(gpus):
    n = np.shape(gpus.c0)[-1]
    return [{k: float(np.asarray(getattr(gpus, k))[g]) for k in ref.PROFILE_KEYS}
            for g in range(n)]


def _workload(serving, n, rng, rate_scale=1.0):
    """`n` requests of a `ServingParams`' workload: Poisson arrivals at its mean rate times
    `rate_scale`, tokens from its token law."""
    rate = float(A.mean_rate(serving.arrivals)) * rate_scale
    arrival = np.cumsum(rng.exponential(1.0 / rate, size=n))
    p, o = sample_tokens_n(jax.random.PRNGKey(int(rng.integers(2 ** 31))), serving.tokens, n)
    return arrival, np.asarray(p), np.asarray(o)


def reference_requests_per_s(kind, params, n, rng, repeats=3):
    """Requests/s of the pure-Python reference on the environment's workload, random decisions
    (Routing: random GPU; Batching: random batch size; Autoscaling: random replica among all,
    at the mean diurnal rate): the best of `repeats` runs on one draw, as the environments'
    timings are the best of their repeats. A single run is not enough: on the 2-core VM of
    2026-12-02 one run of the same draw took 2.3x longer right after a 2 s idle (513k against
    1.18-1.27M requests/s back to back), and single runs inside the benchmark read 0.53-0.59M
    where repeated ones read ~1.2M (docs/benchmarks.md)."""
    if kind == "batching":
        arrival, p, o = _workload(params, n, rng)
        prof = _profiles(params.gpus)[0]
        mb = int(prof["max_batch"])
        actions = rng.integers(0, mb + 1, size=4 * n)  # drawn up front: no RNG in the timing

        def run():
            it = iter(actions)
            ref.simulate_batching(arrival, p, o, prof, lambda *_: int(next(it)))
    else:
        serving = params.serving if kind == "autoscaling" else params
        arrival, p, o = _workload(serving, n, rng)
        profiles = _profiles(serving.gpus)
        gpu = rng.integers(0, len(profiles), size=n)

        def run():
            ref.simulate(arrival, p, o, gpu, profiles)
    return n / best_seconds(run, repeats)


def ppo_steps_per_s(env_name, num_envs, total_steps, label=None, **hparams):
    """PPO training env-steps/s (`agents.train`, excluding compile) with `hparams` over the
    environment's registered training defaults."""
    out = agents.train(env_name, {}, "ppo", total_steps=total_steps, seed=0, num_envs=num_envs,
                       progress=False, **hparams)
    steps = int(out.curves["env_steps"][-1])
    run_s = out.wall_time_s - out.compile_time_s
    return {"env": label or env_name, "num_envs": num_envs, "env_steps": steps,
            "hparams": hparams, "wall_s": out.wall_time_s, "compile_s": out.compile_time_s,
            "steps_per_s": steps / run_s, "steps_per_s_incl_compile": steps / out.wall_time_s}


def cartpole_ppo_settings(env_name: str) -> dict:
    """The hyperparameters that undo `agents.defaults.ENV_DEFAULTS[env_name]["ppo"]`:
    `PPOConfig`'s own defaults (PureJaxRL's CartPole settings: 128-step rollouts, 4 epochs,
    a (64, 64) MLP), so PPO on `env_name` runs exactly CartPole-v1's training program but for
    the environment and its observation size."""

    own = {f.name: f.default for f in dataclasses.fields(PPOConfig)}
    tuned = ENV_DEFAULTS.get(env_name, {}).get("ppo", {})
    out = {k: own[k] for k in tuned if k not in ("total_steps", "num_envs")}
    return {**out, "network": "mlp"}


def environments():
    """(name, env, params, kind, steps divisor, warm-up): a step of the slow environments
    (many arrivals per Autoscaling interval; the continuous engine) gets a shorter scan.
    LLMRouting-v0 runs at its registered load and KV-bound (`llm_kv_bound_env`)."""
    routing, rparams = routing_env()
    return [
        (ROUTING, routing, rparams, "routing", 1, True),
        (ROUTING_DENSE, routing, rparams, "routing", 1, True),
        ("Batching-v0", *jaxserve.make("Batching-v0"), "batching", 1, True),
        # One step is a 15 s control interval (~18 arrivals at the default diurnal load).
        ("Autoscaling-v0 (8 replicas)", *jaxserve.make("Autoscaling-v0"), "autoscaling", 10,
         True),
        ("LLMRouting-v0 (4 OPT-13B replicas)", *jaxserve.make("LLMRouting-v0"), None, 5, True),
        ("LLMRouting-v0 KV-bound (4 A100-40GB, 150 blocks)", *llm_kv_bound_env(), None, 5,
         True),
        ("LLMAutoscaling-v0 (4 OPT-13B replicas)", *jaxserve.make("LLMAutoscaling-v0"), None,
         10, True),
        (BREAKOUT, *gymnax.make("Breakout-MinAtar"), None, 1, True),
    ]


class ZeroObservationRouting(R.Routing):
    """Routing-v0 whose observation is zeros: `profile_routing`'s "no observation" rows (a
    subclass overriding `get_obs`, the environment's own seam)."""

    def get_obs(self, state, params=None, key=None):
        return jnp.zeros(R.NUM_REQUEST_FEATURES + self.num_gpus * R.NUM_GPU_FEATURES)


def profile_routing(counts, steps, repeats):
    """What a vmapped Routing-v0 step spends its time on, by timing variants of the same step
    (same run, from reset): each batched engine path (`lanes.engine_path`), the step with the
    engine replaced by nothing (`engines.StaticEngine(mode="off")`: the cost of everything
    else), the same without reward shaping, then without the observation (zeros,
    `ZeroObservationRouting`) and without the auto-reset (`step_env`), Breakout-MinAtar for
    scale, and the harness alone (`NoOpEnv`). Microseconds per env-step, wall-clock and CPU
    (all threads)."""

    routing, params = routing_env()
    plain = routing.replace_static(shaping_gamma=None)
    off = engines.StaticEngine(mode="off")
    zero_obs = ZeroObservationRouting(default=params, **dataclasses.asdict(plain.static))
    # name: (engine path, env or None for Breakout, auto-reset)
    variants = {"engine: compact": ("compact", routing, True),
                "engine: dense (2 unrolled + loop)": ("dense", routing, True),
                "engine: loop (before compaction)": ("loop", routing, True),
                "compact, no shaping": ("compact", plain, True),
                "compact, no auto-reset (step_env)": ("compact", routing, False),
                "no engine": (None, routing.with_engine(off), True),
                "no engine, no shaping": (None, plain.with_engine(off), True),
                "no engine, no shaping, no observation": (None, zero_obs.with_engine(off),
                                                          True),
                BREAKOUT: (None, None, True),
                "harness only (a no-op environment)": (None, NoOpEnv(), True)}
    out = {}
    try:
        for n in counts:
            for name, (path, env, auto_reset) in variants.items():
                lanes.engine_path = path  # the batched path's documented override
                jax.clear_caches()
                if env is None:
                    env, p = gymnax.make("Breakout-MinAtar")
                else:
                    p = env.default_params if isinstance(env, NoOpEnv) else params
                r = time_env(env, p, n, steps, 0, repeats, auto_reset)
                us = 1e6 / r["reset_steps_per_s"]
                us_cpu = 1e6 * r["reset_cpu_s"] / (n * steps)
                out[f"{name} @ {n}"] = {**r, "us_per_env_step": us, "cpu_us_per_env_step": us_cpu}
                print(f"profile {name:38s} envs={n:6d} compile {r['compile_s']:6.1f}s "
                      f"{us:7.2f} us/env-step ({us_cpu:6.2f} CPU us)", flush=True)
    finally:
        lanes.engine_path = None
        jax.clear_caches()
    return out


def llm_kv_bound_env():
    """LLMRouting-v0 at its registered load (16 req/s) on four OPT-13B A100-40GB replicas
    with 150 KV blocks each (a quarter of the card's 633): KV-bound, preemption-heavy."""

    return jaxserve.make("LLMRouting-v0",
                         replicas=[replica_profile("opt13b-a100-40g", kv_blocks=150)] * 4)


def llm_step_counts(env, params, num_envs, num_steps, warmup_steps):
    """Per env-step engine work of a vmapped LLM environment (random actions), after
    `warmup_steps`: boundary passes (`info["boundaries"]`) per step, their mean and the mean
    over steps of the max over environments (what the vmapped loop pays), iterations per step
    (from the replicas' counters) and preemptions per step."""
    keys = jax.random.split(jax.random.PRNGKey(0), num_envs)
    states = jax.jit(jax.vmap(lambda k: env.reset(k, params)[1]))(keys)

    def iterations(state):
        return getattr(state, "cluster", None).iterations.sum(-1)

    @jax.jit
    def roll(keys, states, steps_key):
        def one(key, state):
            def step(state, k):
                k_a, k_s = jax.random.split(k)
                a = env.action_space(params).sample(k_a)
                _, state, _, _, _, info = env.step(k_s, state, a, params)
                return state, (info["boundaries"], info["preemptions"])
            return jax.lax.scan(step, state, jax.random.split(key, num_steps))
        return jax.vmap(one)(jax.vmap(lambda k: jax.random.fold_in(k, steps_key))(keys),
                             states)

    for i in range(-(-warmup_steps // num_steps)):
        states, _ = roll(keys, states, i + 1)
    it0 = iterations(states)
    states, (b, pre) = roll(keys, states, 10 ** 6)
    b, pre = np.asarray(b), np.asarray(pre)
    it = np.asarray(iterations(states) - it0)  # an auto-reset zeroes the counters: >= 0 rare
    return {"boundaries_per_step": float(b.mean()),
            "boundaries_vmapped_max_per_step": float(b.max(0).mean()),
            "iterations_per_step": float(np.maximum(it, 0).sum() / b.size),
            "preemptions_per_step": float(pre.mean())}


def engine_ceiling(num_envs: int, steps: int, chunks: int) -> dict:
    """What bounds LLMRouting-v0's speed in this engine design (measured: lab/history/
    benchmarks.md, "What bounds this design" in the section of 2026-12-06 (evening)):
    its registered load with random actions in PPO's layout (`paired_curve`: `chunks` chunks
    of `steps` steps), the engine as shipped paired with (1) the boundary loop cut to one
    pass over every replica lane per step (`engines.ContinuousEngine(mode="one_pass")`:
    the least that any engine doing a masked pass per step pays; not exact, replicas fall
    behind) and (2) no engine at all (`mode="off"`: the step's other work), each the same
    environment on that engine (`env.with_engine`). Microseconds per env-step at the steady
    state (median of the second half) and the paired ratios, shipped / variant.
    """
    env, params = jaxserve.make("LLMRouting-v0")
    variants = {"one pass per step": env.with_engine(engines.ContinuousEngine(mode="one_pass")),
                "no engine": env.with_engine(engines.ContinuousEngine(mode="off"))}

    def set_variant(name):
        return None if name == "engine" else (variants[name], params)

    out = {}
    try:
        for other in ("one pass per step", "no engine"):
            r = paired_curve(env, params, num_envs, steps, chunks, set_variant,
                             ("engine", other))
            med = [float(np.median(u[chunks // 2:])) for u in r["us_per_env_step"]]
            out[other] = {**r, "median_us_per_env_step": med}
            print(f"ceiling LLMRouting-v0 envs={num_envs}: engine {med[0]:.1f} us/env-step, "
                  f"{other} {med[1]:.1f} (compile {r['compile_s'][0]:.1f} / "
                  f"{r['compile_s'][1]:.1f} s); engine / {other} paired median "
                  f"{r['median_ratio']:.2f} (min {r['min_ratio']:.2f}, max "
                  f"{r['max_ratio']:.2f})", flush=True)
    finally:
        jax.clear_caches()
    return out


def cap_effects(env, params, num_envs: int, num_steps: int) -> dict:
    """Untimed: `num_steps` steps of `num_envs` LLM routing environments (LLMRouting-v0 or
    LLMPrefixRouting-v0: `params.gpus` and `state.cluster` are their replicas) from reset
    (`benchmark.rollout_tally`: random actions): what the replicas' `max_seqs` changes. Returns
    the share of env-steps at which some replica runs `max_seqs` requests with requests
    waiting (the cap binds), the mean latency of the completed requests (s), completions
    and drops."""
    cap = params.gpus.max_seqs

    def tally(state, info):
        cl = state.cluster
        binds = ((cl.run.count >= cap) & (cl.queues.count > 0)).any(-1).mean()
        return binds, info["latency_sum"].sum(), info["completed"].sum(), info["dropped"].sum()

    bind, lat, done, drop = rollout_tally(env, params, num_envs, num_steps, tally)
    done = int(done.sum())
    return {"cap_binds_share": float(bind.mean()),
            "mean_latency_s": float(lat.sum(dtype=np.float64)) / max(done, 1),
            "completed": done, "dropped": int(drop.sum())}


def parse_widths(spec: str) -> list[int]:
    """`"32,16"` -> [32, 16]; ValueError for anything but comma-separated integers."""
    try:
        return [int(w) for w in spec.split(",")]
    except ValueError:
        raise ValueError(f"--slots expects comma-separated integers, got {spec!r}") from None


def slot_widths(num_envs: int, steps: int, chunks: int, widths) -> dict:
    """LLMRouting-v0 built with its replicas' `max_seqs` lowered to each of `widths` (fewer
    static running slots: every boundary pass works on that many), paired in alternating
    chunks with the registered one (64; `paired_curve`, random actions, PPO's layout), and
    what the lower cap changes at the registered load (`cap_effects` over the same number
    of steps, the registered environment included)."""
    base = jaxserve.make("LLMRouting-v0")
    registered = int(base[1].gpus.max_seqs.max())
    if not all(1 <= w < registered for w in widths):
        raise ValueError(f"--slots widths must be in [1, {registered}), got {list(widths)}")
    out = {"effects": {registered: cap_effects(*base, num_envs, steps * chunks)}}
    for w in widths:
        env_w = jaxserve.make("LLMRouting-v0", replicas=[r.replace(max_seqs=w)
                                                         for r in llm_routing_replicas()])
        r = paired_curve(*base, num_envs, steps, chunks,
                         lambda v, e=env_w: e if v == w else None, (registered, w))
        med = [float(np.median(u[chunks // 2:])) for u in r["us_per_env_step"]]
        out[w] = {**r, "median_us_per_env_step": med}
        out["effects"][w] = cap_effects(*env_w, num_envs, steps * chunks)
        print(f"slots LLMRouting-v0 envs={num_envs}: max_seqs {registered} {med[0]:.1f} "
              f"us/env-step, {w} {med[1]:.1f} (compile {r['compile_s'][0]:.1f} / "
              f"{r['compile_s'][1]:.1f} s); paired median {r['median_ratio']:.2f} (min "
              f"{r['min_ratio']:.2f}, max {r['max_ratio']:.2f}; > 1: {w} faster)", flush=True)
    for w, e in out["effects"].items():
        print(f"slots LLMRouting-v0 max_seqs {w}: the cap binds at {e['cap_binds_share']:.2%} "
              f"of env-steps; mean latency {e['mean_latency_s']:.3f} s over "
              f"{e['completed']:,} completions, {e['dropped']:,} drops "
              f"({num_envs} envs x {steps * chunks} steps, random actions)", flush=True)
    return out


def profile_llm(counts, steps, repeats, warmup):
    """Where a vmapped LLMRouting-v0 step spends its time, at the registered load and KV-bound
    (`llm_kv_bound_env`): the step as shipped (closed-form decode runs), the same running
    every iteration's boundary (`engines.ContinuousEngine(decode_runs=False)`), and with the
    engine replaced by nothing (`mode="off"`: everything else), each the same environment on
    that engine (`env.with_engine`), from reset and after `warmup` steps, with boundary
    passes, iterations and preemptions per step (`llm_step_counts`). Microseconds per
    env-step, wall-clock and CPU."""

    loads = {"registered load": jaxserve.make("LLMRouting-v0"), "KV-bound": llm_kv_bound_env()}
    variants = {"decode runs (default)": engines.CONTINUOUS,
                "every boundary": engines.ContinuousEngine(decode_runs=False),
                "no engine": engines.ContinuousEngine(mode="off")}
    out = {}
    try:
        for n in counts:
            for load, (base, params) in loads.items():
                for name, engine in variants.items():
                    env = base.with_engine(engine)
                    jax.clear_caches()
                    r = time_env(env, params, n, steps, warmup, repeats)
                    if engine.mode != "off":
                        r.update(llm_step_counts(env, params, n, steps, warmup))
                    key = f"LLMRouting-v0 {load}, {name} @ {n}"
                    out[key] = {**r, "us_per_env_step_reset": 1e6 / r["reset_steps_per_s"],
                                "us_per_env_step_warm": 1e6 / r["warm_steps_per_s"]}
                    extra = (f" boundaries/step {r['boundaries_per_step']:6.2f} (vmapped max "
                             f"{r['boundaries_vmapped_max_per_step']:6.2f}) iterations/step "
                             f"{r['iterations_per_step']:6.2f} preemptions/step "
                             f"{r['preemptions_per_step']:5.2f}" if "boundaries_per_step" in r
                             else "")
                    print(f"profile {key:58s} compile {r['compile_s']:5.1f}s "
                          f"{1e6 / r['reset_steps_per_s']:8.1f} us/env-step from reset, "
                          f"{1e6 / r['warm_steps_per_s']:8.1f} warmed{extra}", flush=True)
    finally:
        jax.clear_caches()
    return out


def _short(what: str, width: int = 150) -> str:
    """An op's description for a terminal line: its shape and opcode, then the end of its
    op_name path (the innermost, most telling part)."""
    head, _, path = what.partition(" [")
    head = head if len(head) < 60 else head[:57] + "..."
    room = max(width - len(head) - 3, 20)
    path = path.rstrip("]")
    return head + (f" [{'...' + path[-room:] if len(path) > room else path}]" if path else "")


TRACE_ENVS = ("Routing-v0", "LLMRouting-v0", "LLMPrefixRouting-v0", "LLMAutoscaling-v0")


def trace_env(counts, steps, top=25, name="Routing-v0", warmup=0):
    """Per-XLA-op trace of the bench's compiled scan of `name` (`steps` steps from reset, or
    after `warmup` steps run first in calls of `steps`, e.g. at an LLM env's steady state;
    Routing-v0: the benchmark's workload, `routing_env`; the LLM envs: their registered defaults).

    For each env count: op executions per step, traced op time (self time summed over
    threads, so CPU time) against the untraced wall time of the same call (tracing adds
    overhead per op), and the `top` ops by self time,
    each with its share, executions per step, and shape/opcode/source line from the
    optimized HLO. The run is one call after a warm-up call, so compile is not in it.
    """
    env, params = routing_env() if name == "Routing-v0" else jaxserve.make(name)
    out = {}
    for n in counts:
        run = make_runner(env, params, steps)
        keys = jax.random.split(jax.random.PRNGKey(0), n)
        states = jax.jit(jax.vmap(lambda k: env.reset(k, params)[1]))(keys)
        compiled = run.lower(keys, states).compile()
        ops = hlo_op_summary(compiled.as_text())
        for i in range(-(-warmup // steps)):
            states = compiled(jax.random.split(jax.random.PRNGKey(1 + i), n), states)[0]
        jax.block_until_ready(compiled(keys, states))
        wall = best_seconds(lambda: compiled(keys, states), 3)
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                jax.block_until_ready(compiled(keys, states))
            files = sorted(Path(d).rglob("*.xplane.pb"))
            if not files:
                raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {d}")
            agg = aggregate_trace(str(files[0]))
        total_ns = sum(a["ns"] for a in agg.values())
        env_steps = n * steps
        rows = [{"op": k, "what": ops.get(k, "?"), "per_step": a["count"] / steps,
                 "share": a["ns"] / total_ns, "us_per_step": a["ns"] / 1e3 / steps}
                for k, a in sorted(agg.items(), key=lambda kv: -kv[1]["ns"])]
        execs = sum(a["count"] for a in agg.values()) / steps
        out[n] = {"num_envs": n, "num_steps": steps, "op_executions_per_step": execs,
                  "traced_op_us_per_step": total_ns / 1e3 / steps,
                  "untraced_wall_us_per_step": wall * 1e6 / steps,
                  "untraced_us_per_env_step": wall * 1e6 / env_steps, "top": rows[:top]}
        print(f"trace {name} envs={n}: {execs:,.0f} op executions per step, traced op "
              f"time {total_ns / 1e3 / steps:,.0f} us/step (CPU, all threads), untraced wall "
              f"{wall * 1e6 / steps:,.0f} us/step ({wall * 1e6 / env_steps:.2f} us/env-step)")
        for r in rows[:top]:
            print(f"  {100 * r['share']:5.1f}%  {r['per_step']:6.1f}/step  {r['op']:28s} "
                  f"{_short(r['what'])}")
        if name != "Routing-v0":
            phases = phase_summary(agg, ops, steps, loops=name != "LLMAutoscaling-v0")
            out[n]["phases"] = phases
            print("  by phase of the continuous engine's boundary pass (named scopes):")
            for p in phases:
                print(f"  {100 * p['share']:5.1f}%  {p['per_step']:7.1f} ops/step  "
                      f"{p['loop']:6s} {p['phase']}")
    return out


def prefix_workload(n: int, rng, block_tokens: int = 16):
    """A shared-prefix request stream for the prefix-cache bench: each request takes one of 4
    one-block system prompts (popularity 1/k), walks 0-4 more shared blocks among 3 children
    per node, adds 1-15 private prompt tokens and 1-64 output tokens; Poisson arrivals at
    8 req/s. Returns (gaps, prompt, output, node, tree) with `block_tokens`-token blocks."""
    pop = 1.0 / np.arange(1, 5)
    lists, prompt = [], np.zeros(n, np.int64)
    for i in range(n):
        path = [int(rng.choice(4, p=pop / pop.sum()))]
        path += [100 + 10 * d + int(rng.integers(0, 3)) for d in range(int(rng.integers(0, 5)))]
        lists.append(path)
        prompt[i] = block_tokens * len(path) + int(rng.integers(1, 16))
    tree, node = build_prefix_tree(lists, block_tokens)
    gaps = rng.exponential(1 / 8.0, n)
    return gaps, prompt, rng.integers(1, 65, n), node, tree


def prefix_bench(counts, steps, repeats):
    """Requests routed per second (one request = one env step: route, advance to the next
    arrival, rebase) by the continuous engine with and without prefix caching, vmapped over
    environments that each replay the same shared-prefix stream under their own random
    routing, and the engine state's bytes per environment. 4 replicas of 64 blocks x 16
    tokens, 8 running and 16 waiting slots. Rows: without and with caching, each with the
    decode-run skip on (the default) and off (a boundary per iteration)."""

    rng = np.random.default_rng(0)
    r_n = 4
    prof = stack_replicas([ReplicaProfile(c0=0.01, alpha=2e-5, kv_blocks=64, block_size=16,
                                          max_seqs=8, max_tokens=256, queue_cap=16)] * r_n)
    gaps, prompt, output, node, tree = prefix_workload(steps, rng)
    tables = CB.prefix_tables(tree.parent, tree.depth, 16)
    xs = (jnp.asarray(gaps, jnp.float32), jnp.asarray(prompt, jnp.float32),
          jnp.asarray(output, jnp.float32), jnp.asarray(node, jnp.int32))
    out = []
    for n in counts:
        routes = jnp.asarray(rng.integers(0, r_n, (n, steps)), jnp.int32)
        for caching, skip in ((False, True), (False, False), (True, True), (True, False)):
            blocks = 64 if caching else None

            @jax.jit
            def run(routes):
                def one(r):
                    rep, log, dropped, _, tot, _ = replay_prefix_arrays(
                        prof, tables, *xs, r, num_replicas=r_n, queue_buffer=16,
                        max_seqs=8, blocks=blocks, decode_runs=skip)
                    return rep.iterations.sum(), dropped.sum(), tot["prefix_hit_tokens"]
                return jax.vmap(one)(routes)

            t0 = time.perf_counter()
            compiled = run.lower(routes).compile()
            compile_s = time.perf_counter() - t0
            res = jax.block_until_ready(compiled(routes))
            best = best_seconds(lambda: compiled(routes), repeats)
            state = CB.empty_replicas(r_n, 16, 8, True, blocks)
            nbytes = int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(state)))
            row = {"num_envs": n, "steps": steps, "caching": caching, "decode_runs": skip,
                   "compile_s": compile_s,
                   "run_s": best, "env_steps_per_s": n * steps / best,
                   "state_bytes_per_env": nbytes,
                   "state_mib_4096_envs": nbytes * 4096 / 2 ** 20,
                   "hit_tokens_per_env": float(np.asarray(res[2]).mean()),
                   "dropped_per_env": float(np.asarray(res[1]).mean())}
            out.append(row)
            print(f"prefix caching={caching!s:5s} decode-skip={skip!s:5s} envs={n:6d} "
                  f"compile {compile_s:6.1f}s "
                  f"{row['env_steps_per_s']:11,.0f} env-steps/s  {nbytes:,} B/env "
                  f"({row['state_mib_4096_envs']:.1f} MiB for 4096 envs)  "
                  f"hit tokens/env {row['hit_tokens_per_env']:.0f}", flush=True)
    return out


def prefix_env_bench(counts, steps, repeats, seeds=1):
    """env-steps/s of LLMPrefixRouting-v0 at its registered defaults (random actions, from
    reset, auto-reset on), with prefix caching and without it (`caching=False`: the same
    replicas and trace on LLMRouting-v0's engine), measured in one process, plus state bytes.
    (Rows measured before the env was registered, 2026-12-05, ran the "sessions" workload
    in index order, shaped.)"""

    out = []
    for caching in (True, False):
        env, params = jaxserve.make("LLMPrefixRouting-v0", caching=caching)
        nbytes = state_bytes(env, params)
        for n in counts:
            r = time_env(env, params, n, steps, 0, repeats, seeds=seeds)
            r.update(caching=caching, state_bytes_per_env=nbytes)
            out.append(r)
            print(f"LLMPrefixRouting-v0 caching={caching!s:5s} envs={n:6d}{_seeds(seeds)} "
                  f"compile "
                  f"{r['compile_s']:6.1f}s {r['reset_steps_per_s']:9,.0f} env-steps/s "
                  f"{nbytes:,} B/env", flush=True)
    return out


def _seeds(seeds: int) -> str:
    """The row label's note of a nested-vmap timing (`--seeds`)."""
    return "" if seeds == 1 else f" ({seeds} seeds vmapped)"


def main(argv=None):
    """Runs the benchmark with JAX's persistent compilation cache off, so that every compile
    time it reports is a cold compile (`jaxserve.compile_cache`; restored afterwards)."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return _main(argv)
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def _main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--num-envs", default=None, help="comma-separated env counts")
    ap.add_argument("--num-steps", type=int, default=None, help="scan length per timed call")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps before the warmed timing (--trace: before the traced call; "
                    "default 0 there, from reset)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls (best is kept)")
    ap.add_argument("--only", default=None, help="comma-separated name prefixes to run")
    ap.add_argument("--ppo", action="store_true", help="also time PPO training")
    ap.add_argument("--ppo-envs", type=int, default=256, help="PPO parallel envs (both)")
    ap.add_argument("--ppo-on", default="Routing-v0",
                    help="comma-separated registered environments PPO is timed on (--ppo), "
                         "each against CartPole-v1")
    ap.add_argument("--ppo-steps", type=int, default=None,
                    help="PPO env steps (default 262,144; 16,384 with --quick)")
    ap.add_argument("--profile", action="store_true",
                    help="only time step variants of --profile-env (engine paths, no engine)")
    ap.add_argument("--profile-env", default="Routing-v0", choices=("Routing-v0",
                                                                    "LLMRouting-v0"),
                    help="the environment --profile times (LLMRouting-v0: decode runs on/off, "
                         "no engine, boundaries per step)")
    ap.add_argument("--prefix", action="store_true",
                    help="only the continuous engine with/without prefix caching")
    ap.add_argument("--prefix-env", action="store_true",
                    help="only LLMPrefixRouting-v0's default scenario, caching on/off")
    ap.add_argument("--trace", action="store_true",
                    help="only trace --trace-env's step per XLA op (jax.profiler)")
    ap.add_argument("--trace-env", default="Routing-v0", choices=TRACE_ENVS,
                    help="the environment --trace traces")
    ap.add_argument("--top", type=int, default=25, help="ops listed per env count (--trace)")
    ap.add_argument("--seeds", type=int, default=1,
                    help="time the environments as S seeds' training programs run them: vmap "
                         "over S of vmap over num-envs / S (num-envs counts all)")
    ap.add_argument("--curve", type=int, default=0, metavar="CHUNKS",
                    help="only time CHUNKS consecutive --num-steps-step rollouts from reset "
                         "in PPO's layout (scan of vmap) for the --only environments (default "
                         "the LLM ones): the cost as queues fill, up to the steady state")
    ap.add_argument("--ab", default=None, metavar="FIELD=A,B",
                    help="only a paired A/B of a field of the environment's serving engine "
                         "(core/engines.py; e.g. decode_runs=True,False; values are "
                         "Python literals): --curve chunks (default 12) of the first --only "
                         "environment (default LLMRouting-v0's registered load) at the first "
                         "--num-envs count, A and B compiled in one process and run in "
                         "alternating chunks")
    ap.add_argument("--ceiling", action="store_true",
                    help="only LLMRouting-v0's engine paired with one boundary pass per step "
                         "and with no engine (what bounds this design's speed): --curve "
                         "chunks (default 12) at the first --num-envs count")
    ap.add_argument("--slots", default=None, metavar="W1,W2",
                    help="only LLMRouting-v0 with its replicas' max_seqs lowered to each W "
                         "(fewer running slots per pass), paired with the registered 64 over "
                         "--curve chunks (default 12), and what the lower cap changes")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args(argv)
    counts = ([16, 64] if args.quick else [256, 4096]) if args.num_envs is None \
        else [int(x) for x in args.num_envs.split(",")]
    steps = args.num_steps or (10 if args.quick else 100)
    warmup = args.warmup if args.warmup is not None else (10 if args.quick else 300)
    repeats = args.repeats or (1 if args.quick else 3)
    if args.seeds < 1 or any(n % args.seeds for n in counts):
        ap.error(f"--seeds must be >= 1 and divide every --num-envs count, got {args.seeds}")
    rng = np.random.default_rng(0)

    res = {"device": str(jax.devices()[0]), "backend": jax.default_backend(),
           "jax": jax.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count(),
           "cpu": _cpu_description(),
           "load_average_start": os.getloadavg(), "default_batched_path": C.batched_path(),
           "command": " ".join(["python -m jaxserve.scripts.bench", *(sys.argv[1:] if argv is None
                                                             else argv)]), "results": {}}
    for flag, bench in (("prefix_env", prefix_env_bench), ("prefix", prefix_bench)):
        if getattr(args, flag):  # a mode of its own: only these rows
            res[flag] = (bench(counts, steps, repeats, args.seeds) if flag == "prefix_env"
                         else bench(counts, steps, repeats))
            res["load_average_end"] = os.getloadavg()
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=2))
            return res
    if args.ab or args.slots or args.ceiling:  # the paired modes, each a mode of its own
        chunks = args.curve or 12
        try:
            if chunks < 2:
                raise ValueError("--ab, --slots and --ceiling need --curve >= 2 (pairs are "
                                 "taken over the second half)")
            if args.ab:
                res["ab"] = ab_curve(args.ab, counts[0], steps, chunks,
                                     args.only or "LLMRouting-v0 (4")
            elif args.slots:
                res["slots"] = slot_widths(counts[0], steps, chunks, parse_widths(args.slots))
            else:
                res["ceiling"] = engine_ceiling(counts[0], steps, chunks)
        except ValueError as e:
            ap.error(str(e))
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))
        return res
    if args.curve:
        res["curve"] = curves(counts, steps, args.curve, args.only or "LLM")
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))
        return res
    if args.profile or args.trace:
        if args.profile and args.profile_env == "LLMRouting-v0":
            res["profile"] = profile_llm(counts, steps, repeats, warmup)
        elif args.profile:
            res["profile"] = profile_routing(counts, steps, repeats)
        if args.trace:
            res["trace"] = trace_env(counts, steps, args.top, args.trace_env,
                                     args.warmup or 0)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))
        return res
    for name, env, params, kind, div, warms in environments():
        if args.only and not any(name.startswith(p) for p in args.only.split(",")):
            continue
        lanes.engine_path = "dense" if name == ROUTING_DENSE else None
        jax.clear_caches()  # the batched path is read when a program is traced
        entry = {"state_bytes": state_bytes(env, params), "rows": []}
        n_steps, n_warm = max(steps // div, 2), (warmup // div if warms else 0)
        for n in counts:
            r = time_env(env, params, n, n_steps, n_warm, repeats if div == 1 else 1,
                         seeds=args.seeds)
            entry["rows"].append(r)
            print(f"{name:42s} envs={n:6d}{_seeds(args.seeds)} compile "
                  f"{r['compile_s']:6.1f}s  from reset {r['reset_steps_per_s']:11,.0f}  warmed {r['warm_steps_per_s']:11,.0f} "
                  f"env-steps/s", flush=True)
        if kind is not None:
            entry["reference_requests_per_s"] = reference_requests_per_s(
                kind, params, 2_000 if args.quick else 100_000, rng, repeats)
        res["results"][name] = entry
        if args.out:  # after every environment, so a long run keeps what it measured
            Path(args.out).write_text(json.dumps(res, indent=2))
    lanes.engine_path = None
    jax.clear_caches()

    res["summary"] = summarize(res["results"])
    for line in res["summary"]["lines"]:
        print(line)
    if args.ppo:
        tot = args.ppo_steps or (16_384 if args.quick else 262_144)
        # Each environment twice: with its registered training defaults (Routing-v0: a set
        # network, 8 epochs over 32-step rollouts) and with CartPole-v1's exact settings (like
        # for like), then CartPole-v1 itself.
        names = args.ppo_on.split(",")
        res["ppo"] = []
        for name in names:
            res["ppo"] += [ppo_steps_per_s(name, args.ppo_envs, tot),
                           ppo_steps_per_s(name, args.ppo_envs, tot,
                                           label=f"{name} (CartPole-v1's PPO settings)",
                                           **cartpole_ppo_settings(name))]
        res["ppo"].append(ppo_steps_per_s("CartPole-v1", args.ppo_envs, tot))
        for p in res["ppo"]:
            print(f"PPO {p['env']:40s} envs={p['num_envs']}  {p['steps_per_s']:,.0f} steps/s "
                  f"({p['steps_per_s_incl_compile']:,.0f} incl. {p['compile_s']:.0f} s compile)")
        cartpole = res["ppo"][-1]["steps_per_s"]
        for i, name in enumerate(names):
            own, like = (res["ppo"][2 * i + j]["steps_per_s"] / cartpole for j in (0, 1))
            # The Routing-v0 keys keep their earlier names (lab/bench/bench_cpu*.json).
            tag = "routing" if name == "Routing-v0" else name
            res["summary"][f"ppo_{tag}_vs_cartpole"] = own
            res["summary"][f"ppo_{tag}_same_settings_vs_cartpole"] = like
            print(f"PPO {name} / CartPole-v1: {own:.2f}x (registered defaults), {like:.2f}x "
                  f"(CartPole-v1's settings)")
    res["load_average_end"] = os.getloadavg()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")
    return res


def curves(counts, steps, chunks, only):
    """`rollout_curve` of every `environments()` entry whose name starts with one of `only`'s
    comma-separated prefixes; prints each chunk and the mean of the second half (the steady
    state)."""
    out = {}
    for name, env, params, *_ in environments():
        if not any(name.startswith(p) for p in only.split(",")):
            continue
        for n in counts:
            r = rollout_curve(env, params, n, steps, chunks)
            rates = r["steps_per_s"]
            r["steady_steps_per_s"] = float(np.mean(rates[len(rates) // 2:]))
            out[f"{name} @ {n}"] = r
            print(f"curve {name} envs={n} compile {r['compile_s']:.1f}s, env-steps/s per "
                  f"{steps}-step chunk: " + " ".join(f"{x:,.0f}" for x in rates)
                  + f"; steady (second half) {r['steady_steps_per_s']:,.0f}", flush=True)
    return out


def parse_ab(spec: str) -> tuple[str, tuple[Any, Any]]:
    """`"FIELD=A,B"` -> (FIELD, (A, B)): an A/B of one field of the environment's serving
    engine (`core.engines`, e.g. `decode_runs=True,False` or `mode='exact','one_pass'`;
    values are Python literals). ValueError naming what is wrong (the form, a dotted
    module constant, a value that is not a Python literal)."""
    target, sep, vals = spec.partition("=")
    field = target.strip()
    parts = vals.split(",")
    if "." in field:
        raise ValueError(f"--ab pairs two values of an engine field (FIELD=A,B, e.g. "
                         f"decode_runs=True,False), got {spec!r}: module constants are no "
                         f"longer patched; to compare one, make it a field of its engine "
                         f"(core/engines.py)")
    if not sep or not field.isidentifier() or len(parts) != 2:
        raise ValueError(f"--ab expects FIELD=A,B (a field of the environment's engine), got "
                         f"{spec!r}")
    try:
        values = tuple(ast.literal_eval(p.strip()) for p in parts)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"--ab: values must be Python literals, got {vals!r}") from e
    return field, values


def engine_variant(engine, field: str, value):
    """`engine` with `field` set to `value` (validated by the engine's class); ValueError
    for a field it does not have (its name is not variable) or an invalid value."""
    names = [f.name for f in dataclasses.fields(engine) if f.name != "name"]
    if field not in names:
        raise ValueError(f"--ab: {type(engine).__name__} has no field {field!r}; its fields: "
                         f"{names}")
    return dataclasses.replace(engine, **{field: value})


def ab_curve(spec: str, num_envs: int, steps: int, chunks: int, only: str) -> dict:
    """`benchmark.paired_curve` of the first `environments()` entry whose name starts with one
    of `only`'s prefixes, on its engine with the field `spec` names set to each value in turn
    (`parse_ab`, `engine_variant`; each the environment on that engine, `env.with_engine`)."""
    field, values = parse_ab(spec)
    entry = next((e for e in environments()
                  if any(e[0].startswith(p) for p in only.split(","))), None)
    if entry is None:
        raise ValueError(f"--ab: no environment of this benchmark matches --only {only!r}")
    if chunks < 2:
        raise ValueError("--ab needs --curve >= 2 (pairs are taken over the second half)")
    name, env, params = entry[:3]
    if getattr(type(env), "ENGINE", None) is None:
        raise ValueError(f"--ab: {name} has no serving engine")
    envs = {v: env.with_engine(engine_variant(env.ENGINE, field, v)) for v in values}
    try:
        r = paired_curve(env, params, num_envs, steps, chunks,
                         lambda v: (envs[v], params), values)
    finally:
        jax.clear_caches()
    med = [float(np.median(u[chunks // 2:])) for u in r["us_per_env_step"]]
    print(f"ab {name} envs={num_envs}: engine {field} A={values[0]!r} "
          f"B={values[1]!r}; compile {r['compile_s'][0]:.1f} / {r['compile_s'][1]:.1f} s; "
          f"us/env-step (median of chunks {chunks // 2 + 1}-{chunks}) A {med[0]:.1f} B "
          f"{med[1]:.1f}; paired A/B median {r['median_ratio']:.3f} (min {r['min_ratio']:.3f}, "
          f"max {r['max_ratio']:.3f}; > 1: B faster); sums "
          f"{'equal' if r['sums'][0] == r['sums'][1] else 'DIFFER'}", flush=True)
    return {"env": name, "num_envs": num_envs, "spec": spec, **r}


def summarize(results):
    """Ratios to Breakout-MinAtar (same env count, same start) and to the Python reference."""
    brk = {r["num_envs"]: r for r in results.get(BREAKOUT, {"rows": []})["rows"]}
    out, lines = {}, []
    for name, entry in results.items():
        if name == BREAKOUT:
            continue
        for r in entry["rows"]:
            n, row = r["num_envs"], {}
            for start in ("reset", "warm") if r["warmup_steps"] else ("reset",):
                if n in brk:
                    row[f"{start}_vs_breakout"] = (r[f"{start}_steps_per_s"]
                                                   / brk[n][f"{start}_steps_per_s"])
                if "reference_requests_per_s" in entry:
                    row[f"{start}_requests_per_s"] = (r[f"{start}_steps_per_s"]
                                                      * r["arrivals_per_step"])
                    row[f"{start}_vs_reference"] = (row[f"{start}_requests_per_s"]
                                                    / entry["reference_requests_per_s"])
            out[f"{name} @ {n}"] = row
            text = ", ".join(f"{k} {v:,.2f}" if v < 1e3 else f"{k} {v:,.0f}"
                             for k, v in row.items())
            lines.append(f"{name} @ {n} envs: {text}")
    out["lines"] = lines
    return out


if __name__ == "__main__":
    main()
