"""The benchmark harness: env-steps/s of a gymnax environment under jit(vmap(lax.scan)), the
harness's own floor (`NoOpEnv`), and per-XLA-op analysis of a `jax.profiler` trace.

`scripts/bench.py` runs it over the registered environments (docs/benchmarks.md has the
figures); tests exercise its machinery without timing targets. Times are seconds (wall-clock
unless named CPU), rates are env-steps per second.
"""

from __future__ import annotations

import re
import resource
import time
from collections import defaultdict
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import environment as gymnax_env
from gymnax.environments import spaces as gymnax_spaces


def make_runner(env, params, num_steps, auto_reset=True, seeds=1):
    """jit(vmap(scan)) of random-action steps from given states.

    Returns `run(keys, states) -> (states, checksum, arrived)`: `arrived` counts the requests
    that arrived (0 for gymnax environments). `auto_reset=False` calls `step_env` (no
    auto-reset: the profile's measure of what the reset costs). `seeds` > 1 runs the
    environments as the training programs of several seeds do (`agents.experiments.common.
    train_scenarios`): `vmap` over `seeds` of `vmap` over `num_envs / seeds` environments,
    the layout where each engine's batched loop must merge nested `vmap`s to stay compact.
    """

    def one_env(key, state):
        def step(carry, k):
            state, acc, arrived = carry
            k_a, k_s = jax.random.split(k)
            a = env.action_space(params).sample(k_a)
            if auto_reset:
                obs, state, r, term, trunc, info = env.step(k_s, state, a, params)
            else:
                obs, state, r, term, info = env.step_env(k_s, state, a, params)
            return (state, acc + obs.sum() + r,
                    arrived + jnp.asarray(info.get("arrived", 0), jnp.int32)), None

        (state, acc, arrived), _ = jax.lax.scan(
            step, (state, jnp.float32(0.0), jnp.int32(0)), jax.random.split(key, num_steps))
        return state, acc, arrived

    if seeds == 1:
        return jax.jit(jax.vmap(one_env))

    def nested(keys, states):
        split = lambda x: x.reshape((seeds, x.shape[0] // seeds) + x.shape[1:])  # noqa: E731
        out = jax.vmap(jax.vmap(one_env))(split(keys), jax.tree.map(split, states))
        return jax.tree.map(lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), out)

    return jax.jit(nested)


def cpu_seconds() -> float:
    """CPU seconds this process has used, all threads (user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def best_seconds(fn, repeats, cpu=False):
    """Best wall-clock seconds of `repeats` calls; with `cpu`, also the best CPU seconds."""
    best, best_cpu = np.inf, np.inf
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), cpu_seconds()
        jax.block_until_ready(fn())
        best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, cpu_seconds() - c0)
    return (best, best_cpu) if cpu else best


def time_env(env, params, num_envs, num_steps, warmup_steps, repeats=3, auto_reset=True,
             seeds=1):
    """Compile time, env-steps/s from reset and after `warmup_steps`, arrivals per step.

    Also the CPU time of the best from-reset call (`reset_cpu_s`): on a shared machine it
    moves less with other jobs' load than wall-clock time does. `seeds`: see `make_runner`
    (`num_envs` in all, a multiple of `seeds`; ValueError otherwise).
    """
    if seeds < 1 or num_envs % seeds:
        raise ValueError(f"seeds must be >= 1 and divide num_envs ({num_envs}), got {seeds}")
    run = make_runner(env, params, num_steps, auto_reset, seeds)
    keys = jax.random.split(jax.random.PRNGKey(0), num_envs)
    states = jax.jit(jax.vmap(lambda k: env.reset(k, params)[1]))(keys)
    t0 = time.perf_counter()
    compiled = run.lower(keys, states).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(keys, states))  # first call: allocation, thread pools
    reset_s, reset_cpu_s = best_seconds(lambda: compiled(keys, states), repeats, cpu=True)
    warm = states
    for i in range(-(-warmup_steps // num_steps)):
        warm = compiled(jax.random.split(jax.random.PRNGKey(i + 1), num_envs), warm)[0]
    timed_keys = jax.random.split(jax.random.PRNGKey(10 ** 6), num_envs)
    # An untimed call on the warmed states first, as from reset: the first call on new input
    # buffers costs more (measured 2.7x on LLMRouting-v0 at 256 envs, 4-step scans), which
    # a single timed call (`repeats=1`, the slow environments' setting) would report.
    arrived = int(np.asarray(compiled(timed_keys, warm)[2]).sum())
    # Without warm-up the "warmed" figure is the from-reset one (not timed twice).
    warm_s = best_seconds(lambda: compiled(timed_keys, warm), repeats) if warmup_steps else reset_s
    total = num_envs * num_steps
    return {"num_envs": num_envs, "seeds": seeds, "num_steps": num_steps,
            "warmup_steps": warmup_steps, "compile_s": compile_s, "reset_run_s": reset_s,
            "reset_cpu_s": reset_cpu_s, "warm_run_s": warm_s,
            "reset_steps_per_s": total / reset_s, "warm_steps_per_s": total / warm_s,
            "arrivals_per_step": arrived / total}


def _rollout_chunk(env, params, num_envs: int, chunk_steps: int, tally=None):
    """`chunk(key, states) -> (states, acc)`: a `lax.scan` of `chunk_steps` steps of `vmap`
    over `num_envs` environments with random actions, summing every observation and reward
    into `acc` (so nothing is dead code). With `tally(states, info)` (a pytree of arrays
    per step) the chunk returns `(states, acc, tallies)`, each leaf stacked over the steps."""
    n_act = env.action_space(params).n

    def chunk(key, state):
        def body(carry, k):
            state, acc = carry
            ka, ks = jax.random.split(k)
            a = jax.random.randint(ka, (num_envs,), 0, n_act)
            obs, state, r, _, _, info = jax.vmap(env.step, (0, 0, 0, None))(
                jax.random.split(ks, num_envs), state, a, params)
            return (state, acc + obs.sum() + r.sum()), (None if tally is None
                                                         else tally(state, info))

        (state, acc), ys = jax.lax.scan(body, (state, jnp.float32(0.0)),
                                        jax.random.split(key, chunk_steps))
        return (state, acc) if tally is None else (state, acc, ys)

    return chunk


def reset_states(env, params, num_envs: int):
    """The `num_envs` environments' reset states (keys split from `PRNGKey(0)`)."""
    return jax.jit(jax.vmap(lambda k: env.reset(k, params)[1]))(
        jax.random.split(jax.random.PRNGKey(0), num_envs))


def rollout_tally(env, params, num_envs: int, num_steps: int, tally) -> Any:
    """Untimed: `num_steps` steps of `num_envs` environments from `reset_states`, random
    actions (the timed rollouts' program, key `PRNGKey(1)`), returning `tally(states, info)`
    of every step as NumPy arrays stacked over the steps (leading axis `num_steps`)."""
    chunk = _rollout_chunk(env, params, num_envs, num_steps, tally)
    ys = jax.jit(chunk)(jax.random.PRNGKey(1), reset_states(env, params, num_envs))[2]
    return jax.tree.map(np.asarray, ys)


def rollout_curve(env, params, num_envs: int, chunk_steps: int, chunks: int) -> dict:
    """Env-steps/s of consecutive `chunk_steps`-step rollouts from reset, in PPO's layout.

    A `lax.scan` over steps of `vmap` over environments (as `agents.rollout` runs them),
    random actions, the observation and reward consumed (so nothing is dead code), each
    chunk continuing from the last one's states and timed once: how an environment's cost
    changes as its queues fill, up to its steady state (the bench's "warmed" figure times
    one short call from one state). Compile is excluded (the program is compiled first).
    Returns `{"chunk_steps", "compile_s", "steps_per_s": [per chunk]}`.
    """
    chunk = _rollout_chunk(env, params, num_envs, chunk_steps)
    states = reset_states(env, params, num_envs)
    t0 = time.perf_counter()
    compiled = jax.jit(chunk).lower(jax.random.PRNGKey(1), states).compile()
    compile_s = time.perf_counter() - t0
    rates = []
    for i in range(chunks):
        t = time.perf_counter()
        states, acc = compiled(jax.random.PRNGKey(2 + i), states)
        jax.block_until_ready(acc)
        rates.append(num_envs * chunk_steps / (time.perf_counter() - t))
    return {"chunk_steps": chunk_steps, "compile_s": compile_s, "steps_per_s": rates}


def paired_curve(env, params, num_envs: int, chunk_steps: int, chunks: int,
                 set_variant: Callable[[Any], Any], values: tuple[Any, Any]) -> dict:
    """`rollout_curve` of two variants of one program, timed in alternating chunks.

    `set_variant(v)` configures the code for variant `v` (e.g. sets a module constant read
    when a program is traced); each variant's program is traced and compiled after it, with
    JAX's caches cleared in between, and both start from the same reset states. Where
    `set_variant(v)` returns an `(env, params)` pair, variant `v` times that environment
    instead (e.g. one built with other static sizes), from its own reset states. Chunk `i` of
    both then runs back to back, A first on even `i` and B first on odd `i`, so the machine's
    drift between minutes (which on a shared 2-core VM exceeds many differences worth
    measuring) falls on both alike. Each chunk's `us/env-step(A) / us/env-step(B)` over the
    second half of the chunks (the steady state) is a paired ratio: > 1 where B is faster.
    The caller restores its own configuration afterwards.

    Returns `{"values", "compile_s": [A, B], "us_per_env_step": [[A's chunks], [B's]],
    "ratios", "median_ratio", "min_ratio", "max_ratio", "sums": [A, B]}`; `sums` are the
    last chunk's summed observations and rewards, equal where the variants compute the same
    environment (every chunk starts from its own states and keys: 2 + chunk index).
    """
    shared = reset_states(env, params, num_envs)
    programs, compile_s, state = [], [], []
    for v in values:
        own = set_variant(v)
        jax.clear_caches()
        e, p = own if own is not None else (env, params)
        states = shared if own is None else reset_states(e, p, num_envs)
        chunk = _rollout_chunk(e, p, num_envs, chunk_steps)
        t0 = time.perf_counter()
        programs.append(jax.jit(chunk).lower(jax.random.PRNGKey(1), states).compile())
        compile_s.append(time.perf_counter() - t0)
        state.append(states)
    us = [[], []]
    sums = [0.0, 0.0]
    for i in range(chunks):
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            state[j], acc = programs[j](jax.random.PRNGKey(2 + i), state[j])
            jax.block_until_ready(acc)
            us[j].append((time.perf_counter() - t) * 1e6 / (num_envs * chunk_steps))
            sums[j] = float(acc)
    ratios = [a / b for a, b in zip(us[0][chunks // 2:], us[1][chunks // 2:])]
    return {"values": list(values), "chunk_steps": chunk_steps, "compile_s": compile_s,
            "us_per_env_step": us, "ratios": ratios,
            "median_ratio": float(np.median(ratios)), "min_ratio": min(ratios),
            "max_ratio": max(ratios), "sums": sums}


def state_bytes(env, params):
    """Bytes of one environment's state (a fresh reset), summed over its leaves."""
    _, state = env.reset(jax.random.PRNGKey(0), params)
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(state)))


@struct.dataclass
class _NoOpState:
    time: jax.Array


class NoOpEnv(gymnax_env.Environment):
    """An environment that does nothing but consume its action (Routing-v0's shapes: 8
    actions, 51 observation features): what the harness alone costs per env-step (the key
    split and action draw, gymnax's auto-reset select, the scan)."""

    def step_env(self, key, state, action, params):
        obs = jnp.zeros(51, jnp.float32) + action
        return obs, _NoOpState(state.time + action), jnp.float32(0.0), jnp.bool_(False), {}

    def reset_env(self, key, params):
        return jnp.zeros(51, jnp.float32), _NoOpState(jnp.int32(0))

    def is_terminal(self, state, params):
        return jnp.bool_(False)

    def action_space(self, params=None):
        return gymnax_spaces.Discrete(8)

    @property
    def default_params(self):
        return gymnax_env.EnvParams(max_steps_in_episode=2 ** 30)


def hlo_op_summary(hlo_text: str) -> dict[str, str]:
    """Each instruction of an optimized HLO module's text as `shape opcode [op_name]`, keyed
    by instruction name: what a trace's `hlo_op` names refer to. `op_name` is JAX's path to
    the operation (`jit(...)/vmap()/while/body/...`), which places it in the program."""
    out = {}
    pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+(?: \S+)*?) ([a-z][\w\-]*)\(")
    for line in hlo_text.splitlines():
        m = pattern.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        op_name = re.search(r'op_name="([^"]*)"', line)
        out[name] = f"{shape} {opcode}" + (f" [{op_name.group(1)}]" if op_name else "")
    return out


def aggregate_trace(xplane_path: str) -> dict[str, dict[str, float]]:
    """Executions and self time (ns) of each XLA op in a `jax.profiler.trace` file.

    Reads the events that carry an `hlo_op` stat (XLA CPU thunks), thread by thread, and
    charges each op its self time (`self_times`). Events of several threads overlap in time,
    so the sum is CPU time, not wall time.
    """
    data = jax.profiler.ProfileData.from_file(xplane_path)
    lines = []
    for plane in data.planes:
        for line in plane.lines:
            lines.append([(float(ev.start_ns), float(ev.duration_ns), str(stats["hlo_op"]))
                          for ev in line.events if "hlo_op" in (stats := dict(ev.stats))])
    return self_times(lines)


def self_times(lines) -> dict[str, dict[str, float]]:
    """`{op: {"count", "ns"}}` from events `(start_ns, duration_ns, op)`, one list per thread.

    A control-flow op (`while`, `conditional`) is an event enclosing, on its thread, the
    events of the ops it runs there; each event is charged its duration minus that of the
    events directly nested in it. (XLA:CPU may run a loop body's ops on other threads; those
    are not nested and are not subtracted.)
    """
    agg = defaultdict(lambda: {"count": 0, "ns": 0.0})
    for events in lines:
        stack = []  # [end, name] of the enclosing events
        for start, dur, name in sorted(events, key=lambda e: (e[0], -e[1])):
            while stack and stack[-1][0] <= start:
                stack.pop()
            if stack:
                agg[stack[-1][1]]["ns"] -= dur
            agg[name]["count"] += 1
            agg[name]["ns"] += dur
            stack.append([start + dur, name])
    return dict(agg)


# Named scopes of the continuous engine's boundary pass (`core.continuous.advance`) and of the
# LLM envs' estimates; "apply" (carrying out a decision) is inside "schedule".
ENGINE_PHASES = ("estimates", "end_iteration", "decode_run", "apply", "schedule",
                 "due_and_gate")
_PHASE_RE = {p: re.compile(r"(?:^|[/(])" + p + r"(?:[/)]|$)") for p in ENGINE_PHASES}


def phase_of(what: str) -> tuple[str, str]:
    """`(loop, phase)` of one op from `hlo_op_summary`'s description.

    `phase`: the first of `ENGINE_PHASES` that is a segment of its op_name path ("apply"
    before the "schedule" enclosing it), "rest of the step" for other named ops, "unnamed
    <opcode>" for ops XLA added (copies, fusions without a path). `loop`: for a phase of the
    boundary pass, "dense" when one `while` body encloses it below the env's step (the lane
    loop's dense phase) and "chunks" when two or more do (`lanes`' compact chunks: the chunk
    loop inside the loop over chunks); else "".
    """
    head, _, path = what.partition(" [")
    if not path:
        parts = head.split(" ")
        return "", "unnamed " + (parts[1] if len(parts) > 1 else "?")
    path = path.rstrip("]")
    for phase in ENGINE_PHASES:
        m = _PHASE_RE[phase].search(path)
        if m is None:
            continue
        if phase == "estimates":
            return "", phase
        below = path[:m.start()]
        step = max(below.rfind("jit(step)"), below.rfind("step_env"))
        loops = below[max(step, 0):].count("while/body")
        return ("dense" if loops <= 1 else "chunks"), phase
    return "", "rest of the step"


def phase_summary(agg: dict, ops: dict, steps: int, loops: bool = True) -> list[dict]:
    """`aggregate_trace`'s ops grouped by `phase_of`: each group's share of the traced op time,
    its op time per step (us, CPU) and op executions per step, largest first. `loops=False`
    merges the dense phase and the chunks (for a step whose engine runs inside another loop,
    e.g. LLMAutoscaling-v0's loop over arrivals, where `phase_of`'s count of enclosing loops
    does not tell them apart)."""
    total = sum(a["ns"] for a in agg.values()) or 1.0
    groups = defaultdict(lambda: [0.0, 0])
    for k, a in agg.items():
        loop, phase = phase_of(ops.get(k, "? ?"))
        g = groups[(loop if loops else "", phase)]
        g[0] += a["ns"]
        g[1] += a["count"]
    return [{"loop": loop, "phase": phase, "share": ns / total, "us_per_step": ns / 1e3 / steps,
             "per_step": count / steps}
            for (loop, phase), (ns, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])]
