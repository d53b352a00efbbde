"""Prefix-cache-aware routing: PPO against every production and load-only router ("the study"
of docs/prefix_caching.md; experiment (p) of `scripts/reproduce.py`, CLI
`scripts/prefix_study.py`).

The experiment, per workload and load (`run_prefix_study`):

1. **Workload** (`build_workload`), LLMPrefixRouting-v0 (`envs.llm_prefix_routing`):

   * "system_prompts": `PREFIX_SCENARIOS["system_prompts"]` (eight long shared system
     prompts, docs/prefix_caching.md) on the environment's default cluster
     (`prefix_replicas`: 4 x OPT-13B on A100-40GB, 79 KV blocks of 128 tokens). Training
     trace: the generator's seed 0, the trace the environment builds; evaluation windows:
     the traces of seeds `SYNTHETIC_EVAL_SEED`, +1, ... (independent draws of the same
     process, the synthetic counterpart of "later disjoint windows"). Every trace has
     `window_requests` requests (512, the environment's episode, in the quick and full
     budgets). The best heuristic is chosen (and the fitted routers fitted) on the training
     trace, or with `train_windows=N` on the traces of seeds 0 (the training trace) to
     N - 1: tuning data disjoint from the evaluation seeds (added after the 1M-step runs
     showed how noisy a choice on one trace is: docs/prefix_caching.md).
   * "mooncake": Mooncake's conversation trace (`MOONCAKE_FILE`, 12,031 requests of an hour
     of Kimi's chat traffic, 512-token hash blocks) on `mooncake_replicas` (4 x OPT-13B on
     A100-80GB with KV counted in 512-token blocks: 105 blocks, 53,760 tokens, so the
     engine's `O(M^2)` lookups stay small). Its first `fit_fraction` (25%) of requests is the
     training part: PPO trains on all of it (one episode = the whole part), the best heuristic
     is chosen on `train_windows` disjoint windows of `window_requests` requests spread
     evenly over it, and every policy is evaluated on `eval_windows` disjoint windows spread
     evenly over the rest. The 355 requests (2.95%) whose prompt plus output exceed a
     replica's cache fit no replica: every router drops them alike (each charged
     `drop_penalty_s`, so they add the same constant to every router's mean time in system
     and cancel in the paired differences).

2. **Load** (fixed before any run): one time stretch for the training and evaluation traces
   of a (workload, load) pair. "system_prompts": the arrival rate is `load` times the
   scenario's own (1.5 req/s; arrival times divided by `load`), so `load=1` is the
   environment as registered in docs/prefix_caching.md. "mooncake": the rate of the training
   part is `load` times the cluster's capacity measured on the training windows, as (f)
   measures it (`llm_routing_study.bisect_capacity`: the highest rate at which `jsq_tokens`
   keeps 90% of its light-load SLO attainment; training data only). A time stretch also
   stretches the think time between a session's turns.

3. **Training**: `train_agent` (`algo="ppo"` by default, or "reinforce" with the same
   network): `agents.ppo` with LLMPrefixRouting-v0's settings
   (`agents.defaults.ENV_DEFAULTS`: PureJaxRL's CartPole-v1 PPO, an MLP on the flat
   observation) on the environment as registered (ranked replicas, unshaped reward), one run
   per seed, all seeds in one compiled program (`experiments.common.train_scenarios`).
   (Until commit fa60d44's run the study trained the attention set network on
   index-ordered replicas, `SET_PPO`.)

4. **Evaluation**: every policy replays every window from an empty cluster with the window's
   key (common random numbers: the same noisy output estimates for every policy), greedy
   for the learned ones; all policies and windows of a workload run in one compiled program
   (`replay_windows`) on the index-ordered environment, where the routers name replicas; a
   policy trained on the ranked environment acts there through `ranked_router` (it reads the
   ranked observation and its action's replica is the replica of that rank, as in
   training). Per window (`window_metrics`): (f)'s metrics
   (`llm_routing_study.window_metrics`: TTFT / TPOT / E2E p50 and p99 in s, SLO attainment
   and goodput with the environment's `slo_ttft_s` / `slo_tpot_s`, drops, preemptions, the
   mean time in system with drops charged `drop_penalty_s`, `HEADLINE`) plus the token hit
   rate (cached tokens over looked-up tokens at admissions, readmissions included). Per
   decision, whether a policy routed where `most_cached` would and how loaded that replica
   was (`cache_use`: how the learned router trades the cache against load).

5. **Comparison**: learned minus every heuristic on the evaluation windows: per seed a paired
   Student-t CI over windows, and the seeds together ("ppo_mean") with the crossed seed x
   window bootstrap (`llm_routing_study.compare` / `compare_seeds`). The best heuristic is
   the one with the lowest `HEADLINE` on the training windows only (`select_best`); a
   verdict other than "no significant difference" needs the 95% interval to exclude 0.
"""

from __future__ import annotations

import dataclasses
import time
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.agents.defaults import ALGOS, make_config
from jaxserve.agents.experiments import llm_routing_study as study
from jaxserve.agents.experiments.common import stack_params, train_scenarios
from jaxserve.agents.policy import LearnedPolicy
from jaxserve.core import continuous as CB
from jaxserve.core.replica import (_OPT13B_WEIGHTS_GB, kv_blocks_for, replica_profile,
                                   stack_replicas)
from jaxserve.envs.llm_prefix_routing import (PREFIX_SCENARIOS, PREFIX_SEED,
                                              make_llm_prefix_routing, prefix_replicas,
                                              prefix_workload)
from jaxserve.envs.base import with_static
from jaxserve.evaluation import episodes
from jaxserve.evaluation.evaluate import trace_env
from jaxserve.evaluation.plots import axes_row
from jaxserve.evaluation.replay import token_log
from jaxserve import policies as P
from jaxserve.policies import prefix_routing as PR
from jaxserve.traces import TraceNotFoundError, resolve
from jaxserve.traces.mooncake import MOONCAKE_BLOCK_TOKENS, load_mooncake
from jaxserve.traces.prefix import prefix_window

WORKLOADS = ("system_prompts", "mooncake")
# Every registered cache-aware router (kind "prefix_routing": the production routers and the
# `most_cached` baseline) and every load-only LLM router (kind "llm_routing") but `random` (no
# router's rule) and `sita_prompt` (with identical replicas its two groups are all replicas:
# `jsq_requests` exactly, its docstring). No name is in both kinds.
HEURISTIC_FNS = {n: P.get(n, kind=k).fn for k in ("prefix_routing", "llm_routing")
                 for n in P.names(k)}
HEURISTICS = (P.names("prefix_routing")
              + tuple(n for n in P.names("llm_routing") if n not in ("random", "sita_prompt")))
METRICS = study.METRICS + ("token_hit_rate",)
HIGHER_BETTER = study.HIGHER_BETTER + ("token_hit_rate",)
# Mean time in system per request (s), a dropped request counted at `drop_penalty_s`: the
# reward's quantity (LLMRouting-v0 minimises it) and the selection criterion.
HEADLINE = "e2e_mean_drop_charged"
AGENTS = ("ppo", "reinforce")  # agents.defaults.ALGOS the study trains


def learned_label(algo: str) -> str:
    """The label of an algorithm's seeds together ("ppo_mean")."""
    return f"{algo}_mean"


LEARNED = learned_label("ppo")

SYNTHETIC_EVAL_SEED = 100  # first generator seed of the evaluation windows (training: 0)
MOONCAKE_FILE = "mooncake_2025/conversation_trace.jsonl.gz"  # registry "mooncake_conversation"
MOONCAKE_BLOCK_SIZE = 512  # KV block = the trace's hash block: M = 105 blocks per replica
CALIBRATION_ITERS = 8  # bisection steps of the Mooncake capacity: 1.6% resolution


def mooncake_replicas(max_seqs: int = 16, queue_cap: int = 16):
    """The Mooncake cluster: four `opt13b-a100-80g` replicas (DistServe's OPT-13B fit) with KV
    memory counted in 512-token blocks (`kv_blocks_for(..., block_size=512)` = 105 blocks,
    53,760 tokens: the 80 GB card's cache, so a request of up to ~53k tokens fits; the
    trace's prompt p90 is 27k tokens) and `prefix_replicas`' 16 running and 16 waiting
    slots."""
    kv = kv_blocks_for(40, 5120, 80.0, _OPT13B_WEIGHTS_GB, block_size=MOONCAKE_BLOCK_SIZE)
    return [replica_profile("opt13b-a100-80g", block_size=MOONCAKE_BLOCK_SIZE, kv_blocks=kv,
                            max_seqs=max_seqs, queue_cap=queue_cap)] * 4


# The PPO of the study's earlier runs (to commit fa60d44): LLMRouting-v0's settings with the
# attention set network, which scores every replica with one set of weights, so it can act on
# index-ordered replicas (`tests/prefix_learnability.py --network set` trains it).
SET_PPO = dict(network="set", set_mixer="attention", hidden_sizes=(32, 32), num_envs=16,
               num_steps=64, lr=1e-3, anneal_lr=True, num_minibatches=4, update_epochs=8,
               gamma=0.99, gae_lambda=0.95, ent_coef=0.01)


def train_agent(algo: str, env, params, total_steps: int, seeds: Sequence[int], *, log=None,
                progress: bool = False, **overrides) -> tuple[list[LearnedPolicy], dict]:
    """`algo` ("ppo" or "reinforce") on `(env, params)` with LLMPrefixRouting-v0's settings
    (`agents.defaults.ENV_DEFAULTS`: PureJaxRL's CartPole-v1 PPO with its MLP; REINFORCE with
    the same network), one run per seed in one compiled program
    (`experiments.common.train_scenarios`; seed `s` trains from `jax.random.key(s)`).
    `overrides`: other hyperparameters (`SET_PPO`; `num_envs`, tests). `progress`: a tqdm
    bar on stderr (`train_scenarios`).

    Returns:
      (greedy `LearnedPolicy` per seed, `{"compile_s", "run_s", "final_return": [per seed],
      "config"}`), the final return being the mean episode return of the last update and
      `config` the effective config (`TrainConfig.to_dict`, seed 0's).
    """
    if algo not in AGENTS:
        raise ValueError(f"algo must be one of {AGENTS}, got {algo!r}")
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    if int(total_steps) < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    ctx = None if log is None else _LogContext(log)
    pols, curves = train_scenarios("LLMPrefixRouting-v0", env, [params], algo, seeds,
                                   int(total_steps), ctx=ctx, progress=progress,
                                   **overrides)
    ret = np.asarray(curves["episode_return"])[0]  # (seeds, updates)
    config = make_config(algo, "LLMPrefixRouting-v0", env, int(total_steps), seeds[0],
                         **overrides)
    return pols[0], {"compile_s": float(curves["compile_s"]), "run_s": float(curves["run_s"]),
                     "final_return": [float(r[-1]) for r in ret],
                     "config": config.to_dict()}


def train_ppo(env, params, total_steps: int, seeds: Sequence[int], **kw):
    """`train_agent("ppo", ...)`."""
    return train_agent("ppo", env, params, total_steps, seeds, **kw)


def trained_seeds(trained: dict, algo: str = "ppo") -> list[int]:
    """The seeds of saved networks named `<algo>_seed<s>` (`--save-policies`), in file
    order."""
    seeds, head = [], f"{algo}_seed"
    for name in trained:
        tail = str(name).removeprefix(head)
        if not str(name).startswith(head) or not tail.lstrip("-").isdigit():
            raise ValueError(f"saved networks must be named {head}<int>, got {name!r}")
        seeds.append(int(tail))
    if not seeds:
        raise ValueError("no saved networks")
    return seeds


def load_trained(env, params, trained: dict, total_steps: int, algo: str = "ppo",
                 **overrides) -> tuple[list[LearnedPolicy], dict]:
    """Greedy `LearnedPolicy`s of networks trained earlier (`{"<algo>_seed<s>": params}` as
    `train_agent`'s run saved them) for `(env, params)`, and `train_agent`'s info with no
    timings. Each network's parameters must have the structure and shapes of the network
    `make_config(algo, "LLMPrefixRouting-v0", env, ..., **overrides)` builds."""
    # No training here: the step budget is only recorded (it would be checked against a
    # batch that `overrides` may have changed since).
    config = make_config(algo, "LLMPrefixRouting-v0", env, None, 0, **overrides)
    network = ALGOS[algo][1](config, env, params).network
    obs, _ = env.reset(jax.random.PRNGKey(0), params)
    like = network.init(jax.random.PRNGKey(0), obs)
    spec = jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype.str), like)
    pols = []
    for name, theta in trained.items():
        got = jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype.str), theta)
        if got != spec:
            raise ValueError(f"saved network {name!r} does not match LLMPrefixRouting-v0's "
                             f"default network here (another network, observation or "
                             f"ppo_overrides?)")
        pols.append(LearnedPolicy(network, jax.tree.map(jnp.asarray, theta), True, name))
    return pols, {"compile_s": None, "run_s": None, "final_return": [None] * len(pols),
                  "config": {**config.to_dict(), "total_timesteps": int(total_steps)},
                  "trained_earlier": True}


def fmt_weights(w) -> str:
    """`(a, b, c)` with two decimals, or the three or four a short decimal needs (SGLang's
    1.0001; a third stays 0.33)."""
    def one(x):
        x = float(x)
        places = next((d for d in (2, 3, 4) if abs(round(x, d) - x) < 1e-12), 2)
        return f"{x:.{places}f}"
    return "(" + ", ".join(one(x) for x in w) + ")"


class _LogContext:
    """`train_scenarios` logs through `ctx.log`; this adapts a plain callable."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log


# ------------------------------------------------------------------------------ workloads

def _check_windows(count: int, size: int, span: int, what: str) -> None:
    if count < 1 or size < 2 or count * size > span:
        raise ValueError(f"{count} {what} windows of {size} requests do not fit the "
                         f"{span} requests there")


def spread_windows(lo: int, hi: int, count: int, size: int) -> list[tuple[int, int]]:
    """`count` disjoint windows `[start, start + size)` spread evenly over `[lo, hi)` (the
    first starts at `lo`, the last ends at `hi`). Raises ValueError when they do not fit."""
    _check_windows(count, size, hi - lo, "trace")
    starts = np.round(np.linspace(lo, hi - size, count)).astype(int) if count > 1 else [lo]
    return [(int(s), int(s) + size) for s in starts]


def ranked_router(env, policy) -> Callable:
    """`policy(key, obs)`, trained on the ranked variant of `env` (an LLMPrefixRouting-v0
    environment), as a router of `env`'s states: `router(key, obs, state, params) ->
    replica`, which builds the ranked observation of `state` and returns the replica of the
    chosen rank (`LLMRouting.replica_order`). The inverse of `LLMRouting.replica_policy`:
    with it the learned policy and the routers run in one index-ordered program."""
    ranked = with_static(env, ranked=True)

    def router(key, obs, state, params):
        rank = jnp.clip(jnp.asarray(policy(key, ranked.get_obs(state, params)), jnp.int32),
                        0, env.num_replicas - 1)
        return ranked.replica_order(state, params)[rank]
    return router


def _build(traces, replicas, tokens=None):
    """One environment (shared static shapes: trees padded to the largest) and the stacked
    params of `traces`; `tokens` (a `TokenDist`, e.g. the training params') replaces each
    window's own, so that the observation's request features (log prompt / log
    `max_prompt`) are scaled alike in every window and as in training."""
    nodes = max(t.tree.num_nodes for t in traces)
    depth = max(int(np.max(t.tree.depth)) if t.tree.num_nodes else 1 for t in traces)
    # Index order (ranked=False): the routers name replicas; a learned policy of the
    # ranked environment acts through `ranked_router`.
    built = [make_llm_prefix_routing(trace=t, replicas=replicas, shaping_gamma=None,
                                     ranked=False, tree_nodes=nodes, tree_depth=depth)
             for t in traces]
    plist = [b[1] if tokens is None else b[1].replace(tokens=tokens) for b in built]
    params = stack_params(plist)
    return _shared_env(built[0][0], params), params


# Environments hash by value *including their default params* (`envs.base`: gymnax's
# `step(..., params=None)` bakes them in), so each window set or time stretch would be a new
# static argument and compile `_replay_lanes` again (~30 s each on the 2-core CPU). The
# programs here always pass params explicitly, so any environment with the same static
# configuration and params structure runs them identically: the first one seen stands for all.
_ENVS: dict = {}


def _shared_env(env, params):
    key = (type(env), env.static, jax.tree.structure(params),
           tuple((np.shape(x), np.asarray(x).dtype.str) for x in jax.tree.leaves(params)))
    return _ENVS.setdefault(key, env)


def build_workload(workload: str, load: float, *, window_requests: int, eval_windows: int,
                   train_windows: int | None = None, fit_fraction: float = 0.25,
                   traces_dir=None, log=print) -> dict:
    """The traces of one (workload, load) pair (module docstring, steps 1-2).

    Returns:
      dict: `replicas`; `train_trace` (PPO's, a `PrefixTrace`), `train_windows` and
      `eval_windows` (lists of `PrefixTrace`, `window_requests` each), `windows` (their
      generator seeds or `[start, stop)` rows), `rate` (req/s of the training trace),
      `factor` (time stretch applied to the workload's own times), `capacity` (req/s that
      `load` multiplies) and `basis`, `calibration` (Mooncake's capacity search, else None),
      `never_fit` (requests no replica can hold, per evaluation window).
    """
    load = float(load)
    if not np.isfinite(load) or load <= 0:
        raise ValueError(f"load must be finite and > 0, got {load}")
    n = int(window_requests)
    if workload == "system_prompts":
        _check_windows(int(eval_windows), n, n * int(eval_windows), "evaluation")
        scale = 1.0 / load
        tw = 1 if train_windows is None else int(train_windows)
        if not 1 <= tw <= SYNTHETIC_EVAL_SEED - PREFIX_SEED:
            raise ValueError(f"train_windows must be in [1, {SYNTHETIC_EVAL_SEED - PREFIX_SEED}]"
                             f" for system_prompts (its seeds must not reach the evaluation "
                             f"seeds), got {train_windows}")
        tuning = [prefix_window(prefix_workload(n, PREFIX_SEED + w, scenario=workload), 0, n,
                                scale) for w in range(tw)]
        train = tuning[0]
        seeds = [SYNTHETIC_EVAL_SEED + w for w in range(int(eval_windows))]
        evals = [prefix_window(prefix_workload(n, s, scenario=workload), 0, n, scale)
                 for s in seeds]
        base = float(PREFIX_SCENARIOS[workload]["config"]["session_rate"])
        reps = None
        out = {"train_trace": train, "train_windows": tuning, "eval_windows": evals,
               "windows": {"train": [PREFIX_SEED + w for w in range(tw)], "eval": seeds},
               "factor": scale,
               "capacity": base, "basis": "the scenario's session rate (req/s)",
               "calibration": None}
    elif workload == "mooncake":
        try:
            path = resolve(MOONCAKE_FILE, traces_dir)
        except TraceNotFoundError as e:
            raise TraceNotFoundError(f"Mooncake trace not found: {e}") from None
        if not 0.0 < float(fit_fraction) < 1.0:
            raise ValueError(f"fit_fraction must be in (0, 1), got {fit_fraction}")
        raw = _load_mooncake(str(path))
        total = len(raw)
        cut = int(round(total * float(fit_fraction)))
        tw = int(eval_windows if train_windows is None else train_windows)
        train_rows = spread_windows(0, cut, tw, n)
        eval_rows = spread_windows(cut, total, int(eval_windows), n)
        reps = mooncake_replicas()
        a = np.asarray(raw.trace.arrival_s[:cut], np.float64)
        rate0 = (cut - 1) / (a[-1] - a[0])
        key = (str(path), cut, tuple(train_rows))
        if key not in _CAPACITY:  # it does not depend on the load: measured once per process
            _CAPACITY[key] = mooncake_capacity(raw, train_rows, rate0, reps)
            cal = _CAPACITY[key]
            log(f"mooncake: capacity {cal['capacity']:.4f} req/s ({cal['policy']} attains "
                f"{cal['attainment']:.3f} there, {cal['light_attainment']:.3f} at a light "
                f"load; {cal['replays']} replays, {cal['seconds']:.0f} s)")
        cal = dict(_CAPACITY[key])
        factor = rate0 / (load * cal["capacity"])
        out = {"train_trace": prefix_window(raw, 0, cut, factor),
               "train_windows": [prefix_window(raw, lo, hi, factor) for lo, hi in train_rows],
               "eval_windows": [prefix_window(raw, lo, hi, factor) for lo, hi in eval_rows],
               "windows": {"train": train_rows, "eval": eval_rows}, "factor": factor,
               "capacity": cal["capacity"], "calibration": cal,
               "basis": "the capacity measured on the training windows (req/s)"}
    else:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    tr = out["train_trace"].trace
    out["replicas"] = reps
    out["rate"] = float((len(tr) - 1) / (tr.arrival_s[-1] - tr.arrival_s[0]))
    out["never_fit"] = [_never_fit(w, reps) for w in out["eval_windows"]]
    return out


_CAPACITY: dict = {}


@lru_cache(maxsize=2)
def _load_mooncake(path: str):
    return load_mooncake(path, block_tokens=MOONCAKE_BLOCK_TOKENS)


def mooncake_capacity(raw, train_rows, rate: float, replicas) -> dict:
    """The capacity Mooncake's loads are multiples of: (f)'s measurement
    (`llm_routing_study.bisect_capacity`, `CALIBRATION_ITERS` bisection steps) with the SLO
    attainment of `llm_routing_study.CALIBRATION_POLICY` (JSQ by tokens) averaged over the
    training windows `train_rows` of `raw`, each replayed from an empty cluster with its
    times stretched; `rate` (req/s): the training part's own rate, which a stretch `s`
    turns into `rate / s`. Returns `bisect_capacity`'s dict plus `policy` and `seconds`."""
    t0 = time.perf_counter()
    name = study.CALIBRATION_POLICY

    def attainment(stretch: float) -> float:
        wins = [prefix_window(raw, lo, hi, stretch) for lo, hi in train_rows]
        env, params = _build(wins, replicas)
        res = replay_windows(env, params, wins, {name: HEURISTIC_FNS[name]},
                             keys=jax.random.split(jax.random.PRNGKey(0), len(wins)))
        return float(np.mean(res[name]["slo_attainment"]))

    cal = study.bisect_capacity(attainment, rate, iters=CALIBRATION_ITERS)
    return {**cal, "policy": name, "seconds": time.perf_counter() - t0}


def _never_fit(ptrace, replicas) -> int:
    """Requests of `ptrace` that fit no replica (the engine's own rule,
    `continuous.never_fits`, per request and replica)."""
    prof = stack_replicas(replicas or prefix_replicas())
    t = ptrace.trace
    never = jax.vmap(lambda p, o: CB.never_fits(prof, p, o))(
        jnp.asarray(t.prompt_tokens, jnp.int32), jnp.asarray(t.output_tokens, jnp.int32))
    return int(np.asarray(never).all(-1).sum())


# ----------------------------------------------------------------------------- evaluation

@dataclasses.dataclass(frozen=True)
class NetworkLane:
    """A learned network as a parametric lane of `_replay_lanes`: `lane(env, theta, key, obs,
    state, params) -> replica`, greedy, through `ranked_router` when the network was trained
    on the ranked environment."""

    network: Any
    ranked: bool = True

    def __call__(self, env, theta, key, obs, state, params):
        net = LearnedPolicy(self.network, theta)
        if self.ranked:
            return ranked_router(env, net)(key, obs, state, params)
        return net(key, obs)


@partial(jax.jit, static_argnames=("env", "heuristics", "lane_fn"))
def _replay_lanes(env, heuristics, lane_fn, params, keys, theta):
    """Every lane (heuristic `h` for lanes `h < H`, then `lane_fn` with `theta[k]` for lane
    `H + k`: a learned network, `NetworkLane`, or a candidate of a fitted router,
    `fitted_lane`) on every window of `params` (leading axis W), one episode
    each from `env.reset_env(keys[w])` through the trace's end (its last step drains).

    The lanes run one after another (`lax.map`: the `switch` on an unbatched lane index
    branches, so a step computes one policy, not all of them); the windows of a lane run in
    parallel (`vmap`). Key layout per window as `evaluation.replay._run_policy`'s: step `i`
    with `split(fold_in(key, 1), n)[i]`, the policy with `fold_in(fold_in(key, 2), i)`.

    Returns `(TokenLog, (dropped, replica, hit_tokens, lookup_tokens, follows,
    load_ratio))`, leaves `(lanes, W, n)`: per decision, besides the step's counters,
    whether the request went where `most_cached` would have sent it and that replica's
    tokens in flight over the replicas' mean (`continuous.tokens_in_flight`, before the
    decision): what a router reads when it leaves the cache.
    """
    H = len(heuristics)
    K = 0 if theta is None else jax.tree.leaves(theta)[0].shape[0]
    n = params.trace.gap.shape[-1]
    num_replicas = env.num_replicas

    def window(p, key, lane):
        obs, state = env.reset_env(key, p)
        k_pol = jax.random.fold_in(key, 2)
        pol_keys = jax.vmap(lambda i: jax.random.fold_in(k_pol, i))(jnp.arange(n))
        env_keys = jax.random.split(jax.random.fold_in(key, 1), n)
        branches = [partial(lambda h, k, o, s: jnp.asarray(h(k, o, s, p), jnp.int32), h)
                    for h in heuristics]
        if K:
            th = jax.tree.map(lambda x: x[jnp.clip(lane - H, 0, K - 1)], theta)
            branches.append(lambda k, o, s: jnp.asarray(lane_fn(env, th, k, o, s, p),
                                                        jnp.int32))

        def act(i, k, o, s):
            return jax.lax.switch(jnp.minimum(lane, len(branches) - 1), branches, k, o, s)

        def fold(before, s: episodes.Step):  # `before`: the state the decision read
            replica = jnp.clip(s.action, 0, num_replicas - 1)
            cached = PR.most_cached(None, None, before, p)
            load = CB.tokens_in_flight(before.cluster)
            ratio = load[cached] / jnp.maximum(load.mean(), 1.0)
            return s.state, (s.info["dropped"], replica, s.info["prefix_hit_tokens"],
                             s.info["prefix_lookup_tokens"], replica == cached, ratio)

        _, state, _, _, ys = episodes.scan_steps(env, act, p, obs, state, pol_keys, env_keys,
                                                 fold=fold, acc=state)
        return state.log, ys

    lanes = jnp.arange(H + K, dtype=jnp.int32)
    return jax.lax.map(lambda lane: jax.vmap(window, (0, 0, None))(params, keys, lane), lanes)


def replay_lanes(env, params, windows, heuristics: dict, lane_fn=None,
                 thetas: dict | None = None, *, keys, decisions: dict | None = None) -> dict:
    """Every heuristic (name -> router) and every parametric lane (name -> `theta` of
    `lane_fn`, all of one structure) on every window: `{name: {metric: (W,) array}}` of
    `METRICS`.

    `env, params`: one environment and the windows' stacked params (`_build`); `windows`: the
    `PrefixTrace`s in that order; `keys`: `(W,)` PRNG keys, window `w` replayed with
    `keys[w]` by every policy (common random numbers). `decisions`: a dict that receives,
    per policy, `follows` and `load_ratio`, `(W, n)` arrays of `_replay_lanes`'
    per-decision records.
    """
    thetas = thetas or {}
    if thetas and lane_fn is None:
        raise ValueError("thetas need a lane_fn")
    env_t = trace_env(env, len(windows[0]))
    theta = (jax.tree.map(lambda *x: jnp.stack([jnp.asarray(v) for v in x]), *thetas.values())
             if thetas else None)
    log, (dropped, replica, hit, look, follows, ratio) = jax.device_get(_replay_lanes(
        env_t, tuple(heuristics.values()), lane_fn if thetas else None, params, keys, theta))
    slo_ttft, slo_tpot = (float(np.asarray(params.slo_ttft_s).ravel()[0]),
                          float(np.asarray(params.slo_tpot_s).ravel()[0]))
    drop_s = float(np.asarray(params.drop_penalty_s).ravel()[0])
    out = {}
    for li, name in enumerate([*heuristics, *thetas]):
        rows = []
        for w, win in enumerate(windows):
            res = token_log(win.trace, replica[li, w],
                            jax.tree.map(lambda x: x[li, w], log), dropped[li, w])
            m = study.window_metrics(res, win.trace.output_tokens, slo_ttft=slo_ttft,
                                     slo_tpot=slo_tpot, drop_penalty_s=drop_s)
            m["token_hit_rate"] = float(hit[li, w].sum() / max(float(look[li, w].sum()), 1.0))
            rows.append(m)
        out[name] = {m: np.array([r[m] for r in rows]) for m in METRICS}
        if decisions is not None:
            decisions[name] = {"follows": follows[li], "load_ratio": ratio[li]}
    return out


def replay_windows(env, params, windows, heuristics: dict, learned: dict | None = None, *,
                   keys, ranked: bool = True, decisions: dict | None = None) -> dict:
    """Every policy on every window (`replay_lanes`): `heuristics`, name -> router; `learned`,
    name -> `LearnedPolicy`, all of one network, trained on the ranked environment when
    `ranked` (else on `env` itself)."""
    learned = learned or {}
    nets = {p.network for p in learned.values()}
    if len(nets) > 1:
        raise ValueError("learned policies must share one network")
    lane = NetworkLane(nets.pop(), bool(ranked)) if learned else None
    return replay_lanes(env, params, windows, heuristics, lane,
                        {n: p.params for n, p in learned.items()}, keys=keys,
                        decisions=decisions)


def simplex_grid(steps: int) -> list[tuple[float, float, float]]:
    """The weight triples `(i, j, k) / steps` with `i + j + k = steps` (argmax of a weighted
    score is unchanged by scaling the weights, so the simplex covers every router of the
    family)."""
    return [(i / steps, j / steps, (steps - i - j) / steps)
            for i in range(steps + 1) for j in range(steps + 1 - i)]


# llm-d's weights tried by `fit_llmd`: the simplex in steps of 1/6 (28 triples) and the
# default profile (2, 2, 3), which lies between its points (unscaled, so that its lane is
# `llmd_scorers` exactly: the fitted router is never worse than the default on the windows
# it is fitted on).
LLMD_GRID = tuple(simplex_grid(6)) + (PR.LLMD_DEFAULT,)
TUNED_LLMD = "llmd_tuned"


# Load guards tried for `guarded_tuned`: the cached replica's tokens in flight over the mean.
GUARD_GRID = (0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)
TUNED_GUARD = "guarded_tuned"
# SGLang's thresholds tried for `sglang_tuned`: (cache_threshold, balance_abs, balance_rel).
# LLMPrefixRouting-v0's replicas hold at most 32 requests (16 running, 16 waiting), so the
# default balance_abs of 64 never fires there: smaller ones are tried, and 64 (the default's
# "never") once per cache threshold, since balance_rel is then moot. The default triple is
# on the grid, so the fitted router is never worse than the default on the tuning windows.
SGLANG_GRID = tuple((c, a, r) for c in (0.1, 0.3, 0.5, 0.8) for a in (2.0, 4.0, 8.0, 16.0)
                    for r in (1.0001, 1.5)) + tuple(
                        (c, float(PR.SGLANG_BALANCE_ABS), PR.SGLANG_BALANCE_REL)
                        for c in (0.1, 0.3, 0.5, 0.8))
TUNED_SGLANG = "sglang_tuned"
# AIBrix's thresholds tried for `aibrix_tuned`: (imbalance_abs, std_factor). An imbalance of
# 32 cannot be exceeded here (at most 32 requests per replica) and a factor of 100 never
# skips a replica, so the grid holds both guards off. The default (8, 1) is on it.
AIBRIX_GRID = tuple((a, f) for a in (2.0, 4.0, 8.0, 16.0, 32.0)
                    for f in (0.5, 1.0, 2.0, 100.0))
TUNED_AIBRIX = "aibrix_tuned"

# The fitted families, in `fitted_lane`'s branch order: name -> (the router of a traceable
# parameter vector `(theta, state, params) -> int32 replica`, the number of parameters, the
# policy of a fitted vector, which validates it).
FAMILIES = {
    TUNED_LLMD: (PR.llmd_weighted_route, 3, PR.llmd_weighted),
    TUNED_GUARD: (lambda th, s, p: PR.cache_guarded_route(th[0], s, p), 1,
                  lambda w: PR.cache_guarded(w[0])),
    TUNED_SGLANG: (PR.sglang_route, 3, PR.sglang_thresholds),
    TUNED_AIBRIX: (PR.aibrix_route, 2, PR.aibrix_thresholds),
}
_THETA = 1 + max(n for _, n, _ in FAMILIES.values())  # family index, then parameters


def fitted_lane(env, theta, key, obs, state, params):
    """A candidate of a fitted family as a parametric lane of `_replay_lanes`: `theta[0]`
    is the family's index in `FAMILIES`, `theta[1:]` its parameters (zero-padded). The
    family is a `lax.switch` on a lane constant, so a lane computes its own router only, and
    every family's candidates share one compiled replay (`fit_tuned`)."""
    branches = [partial(lambda f, n, th: jnp.asarray(f(th[:n], state, params), jnp.int32), f, n)
                for f, n, _ in FAMILIES.values()]
    return jax.lax.switch(theta[0].astype(jnp.int32), branches, theta[1:])


def fit_tuned(env, params, windows, keys, grids: dict, metric: str = HEADLINE) -> dict:
    """Fitted families on tuning windows: every parameter tuple of `grids[name]` (names of
    `FAMILIES`) replays every window (`params`, `windows`, `keys` as `replay_lanes'`), all
    of them in one program, and per family the lowest mean `metric` wins (ties: the first
    in its grid). An empty grid leaves its family out.

    Returns `{name: {"weights": best tuple, "value": its mean, "grid": [[w, mean], ...]}}`.

    Raises:
      ValueError: an unknown family, or a tuple its policy factory rejects (wrong length,
      negative or non-finite values; the message names the family)."""
    unknown = sorted(set(grids) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown fitted families {unknown}; known: {list(FAMILIES)}")
    order = list(FAMILIES)
    lanes, thetas = [], {}
    for name, grid in grids.items():
        _, size, make = FAMILIES[name]
        for i, w in enumerate(grid):
            w = tuple(float(x) for x in np.atleast_1d(np.asarray(w, np.float64)))
            make(w)  # validates
            if len(w) != size:
                raise ValueError(f"{name}: each candidate needs {size} values, got {w}")
            lane = f"{name}/{i}"
            lanes.append((name, w, lane))
            thetas[lane] = jnp.asarray((order.index(name), *w, *[0.0] * (_THETA - 1 - size)),
                                       jnp.float32)
    if not lanes:
        return {}
    out = replay_lanes(env, params, windows, {}, fitted_lane, thetas, keys=keys)
    fits = {}
    for name in grids:
        rows = [(w, float(np.mean(out[lane][metric]))) for n, w, lane in lanes if n == name]
        if rows:
            i = int(np.argmin([v for _, v in rows]))
            fits[name] = {"weights": list(rows[i][0]), "value": rows[i][1],
                          "grid": [[list(w), v] for w, v in rows]}
    return fits


def fit_llmd(env, params, windows, keys, grid=LLMD_GRID, metric: str = HEADLINE) -> dict:
    """llm-d's scorer weights (queue, KV cache, prefix; `PR.llmd_score`) fitted on tuning
    windows (`fit_tuned` for this family alone). Returns `{"weights": best triple,
    "value": its mean, "grid": [[w, mean], ...]}`."""
    if len(grid) == 0:
        raise ValueError("grid must hold at least one weight triple")
    return fit_tuned(env, params, windows, keys, {TUNED_LLMD: grid}, metric)[TUNED_LLMD]


def fit_guard(env, params, windows, keys, grid=GUARD_GRID, metric: str = HEADLINE) -> dict:
    """`cache_guarded`'s load guard fitted on tuning windows, as `fit_llmd` fits llm-d's
    weights. Returns `{"weights": [best guard], "value", "grid": [[[g], mean], ...]}`."""
    if len(grid) == 0:
        raise ValueError("grid must hold at least one load guard")
    return fit_tuned(env, params, windows, keys, {TUNED_GUARD: grid}, metric)[TUNED_GUARD]


def window_keys(eval_seed: int, part: str, count: int) -> jax.Array:
    """The study's replay keys: window `w` of the evaluation ("eval") or training ("train")
    windows replays with `fold_in(fold_in(PRNGKey(eval_seed), 0 or 1), w)`. `(count,)`."""
    k = jax.random.fold_in(jax.random.PRNGKey(int(eval_seed)), {"eval": 0, "train": 1}[part])
    return jax.vmap(lambda w: jax.random.fold_in(k, w))(jnp.arange(int(count)))


def select_best(train_per_window: dict, heuristics: Sequence[str],
                metric: str = HEADLINE) -> tuple[str, dict]:
    """The heuristic with the lowest mean `metric` over the *training* windows (ties: the
    first in `heuristics`), and every heuristic's mean there."""
    values = {h: float(np.mean(train_per_window[h][metric])) for h in heuristics}
    return min(values, key=values.get), values


# ---------------------------------------------------------------------------------- study

def run_prefix_study(*, workload: str = "system_prompts", load: float = 1.0,
                     seeds: Sequence[int] = (0, 1, 2), total_steps: int = 65_536,
                     eval_windows: int = 4, train_windows: int | None = None,
                     window_requests: int = 512, fit_fraction: float = 0.25,
                     heuristics: Sequence[str] | None = None, ppo_overrides: dict | None = None,
                     eval_seed: int = 20261202, traces_dir=None, log=print,
                     keep_policies: bool = False, progress: bool = False,
                     tune: bool = True, llmd_grid=LLMD_GRID, guard_grid=GUARD_GRID,
                     sglang_grid=SGLANG_GRID, aibrix_grid=AIBRIX_GRID,
                     trained: dict | None = None, algo: str = "ppo") -> dict:
    """Trains PPO (one run per seed) and evaluates it against the heuristics (module
    docstring).

    Args:
      workload: "system_prompts" or "mooncake".
      load: the offered load's multiplier (module docstring, step 2: of the scenario's rate,
        or of Mooncake's measured capacity).
      seeds: PPO seeds; total_steps: env steps per seed.
      eval_windows: evaluation windows (>= 2); train_windows: the selection windows
        (Mooncake: default `eval_windows`; system_prompts: default 1, the training trace,
        else generator seeds 0 to N - 1);
        window_requests: requests per window (and per synthetic trace).
      fit_fraction: Mooncake's training part.
      heuristics: names from `HEURISTICS` (default all of them).
      ppo_overrides: PPO hyperparameters replacing LLMRouting-v0's (tests: `num_envs`,
        `num_steps`).
      eval_seed: evaluation key: window `w` of the evaluation (training) windows replays with
        `fold_in(fold_in(PRNGKey(eval_seed), 0), w)` (`..., 1), w)`).
      progress: a tqdm bar on stderr while PPO trains.
      keep_policies: also return the learned policies (`policies`: name -> `LearnedPolicy`,
        not JSON-able: pop it before serialising).
      tune: also run the heuristics fitted on the training windows (`fit_tuned`, one
        program for all): `TUNED_LLMD`, llm-d's weighted scorers with the weights of
        `llmd_grid` that do best there; `TUNED_GUARD`, `most_cached` with the load guard of
        `guard_grid` that does best there; `TUNED_SGLANG` and `TUNED_AIBRIX`, SGLang's and
        AIBrix's routers with the thresholds of `sglang_grid` / `aibrix_grid` that do best
        there (the production routers fitted on tuning data). An empty grid leaves its
        router out.
      trained: networks trained earlier (`{"<algo>_seed<s>": params}`, as `--save-policies`
        writes them, for LLMPrefixRouting-v0's default network with `ppo_overrides`):
        evaluated instead of training (their seeds replace `seeds`; `total_steps` is only
        recorded).
      algo: the learning algorithm, "ppo" or "reinforce" (`AGENTS`); its seeds are
        `<algo>_seed<s>`, together `learned_label(algo)`. `ppo_overrides` are its
        hyperparameters whichever it is (the name predates REINFORCE here).

    Returns:
      JSON-able dict: `config`, `workload` (rate, factor, capacity, basis, calibration,
      windows, never-fit requests), `training` (seeds, compile/run s, final returns),
      `per_window` (`eval` / `train`: policy -> metric -> list), `summary` (the same, means
      over windows), `selection` (the training windows' `HEADLINE` per heuristic and the
      best), `headline` (learned minus the best heuristic: the seeds' crossed bootstrap and
      per seed), `paired` (learned minus every heuristic, every metric, per seed and
      "ppo_mean"), `routing` (per policy, `cache_use` over the evaluation windows' decisions),
      `seconds`.

    Raises:
      ValueError: unknown workload or heuristic, empty seeds, a non-positive load or step
      count, fewer than 2 evaluation windows, windows that do not fit the trace, `trained`
      networks not named `<algo>_seed<int>` or not of the default network's structure, an
      unknown algo.
    """
    t0 = time.perf_counter()
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if algo not in AGENTS:
        raise ValueError(f"algo must be one of {AGENTS}, got {algo!r}")
    label = learned_label(algo)
    if trained is not None:
        seeds = trained_seeds(trained, algo)
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must name at least one seed, each once, got {seeds}")
    if int(total_steps) < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if int(eval_windows) < 2:
        raise ValueError(f"eval_windows must be >= 2 (a paired CI needs two), got "
                         f"{eval_windows}")
    names = list(HEURISTICS if heuristics is None else heuristics)
    unknown = sorted(set(names) - set(HEURISTICS))
    if unknown or not names:
        raise ValueError(f"unknown heuristic(s) {unknown}; known: {list(HEURISTICS)}")
    wl = build_workload(workload, load, window_requests=window_requests,
                        eval_windows=eval_windows, train_windows=train_windows,
                        fit_fraction=fit_fraction, traces_dir=traces_dir, log=log)
    reps = wl["replicas"]
    log(f"{workload} @ load {load:g}: rate {wl['rate']:.4f} req/s (time x {wl['factor']:.3f}); "
        f"{algo} trains on {len(wl['train_trace'])} requests; {len(wl['train_windows'])} "
        f"training and {len(wl['eval_windows'])} evaluation windows of {window_requests}")

    # The environment as registered (ranked replicas, no shaping), on the training trace.
    env, params = make_llm_prefix_routing(trace=wl["train_trace"], replicas=reps)
    if trained is None:
        pols, training = train_agent(algo, env, params, int(total_steps), seeds, log=log,
                                     progress=progress, **(ppo_overrides or {}))
        log(f"trained {len(seeds)} seed(s) x {int(total_steps):,} steps: compile "
            f"{training['compile_s']:.0f} s, run {training['run_s']:.0f} s")
    else:
        pols, training = load_trained(env, params, trained, int(total_steps), algo,
                                      **(ppo_overrides or {}))
        log(f"evaluating {len(pols)} network(s) trained earlier (seeds {seeds})")
    learned = {f"{algo}_seed{s}": p for s, p in zip(seeds, pols)}

    # One program for the training and evaluation windows (trees padded alike).
    wins = wl["train_windows"] + wl["eval_windows"]
    env_w, params_w = _build(wins, reps, params.tokens)
    heur = {h: HEURISTIC_FNS[h] for h in names}
    t1 = time.perf_counter()
    nt = len(wl["train_windows"])
    keys = jnp.concatenate([window_keys(eval_seed, "train", nt),
                            window_keys(eval_seed, "eval", len(wl["eval_windows"]))])
    tuned = {}
    grids = {TUNED_LLMD: llmd_grid, TUNED_GUARD: guard_grid, TUNED_SGLANG: sglang_grid,
             TUNED_AIBRIX: aibrix_grid}
    if tune:
        t2 = time.perf_counter()
        tuned = fit_tuned(env_w, jax.tree.map(lambda x: x[:nt], params_w),
                          wl["train_windows"], keys[:nt], grids)
        for name, fit in tuned.items():
            heur[name] = FAMILIES[name][2](fit["weights"])
            names.append(name)
            log(f"{name}: {fmt_weights(fit['weights'])}, {fit['value']:.2f} s on the "
                f"training windows ({len(fit['grid'])} values)")
        log(f"fitted {len(tuned)} families ({sum(len(f['grid']) for f in tuned.values())} "
            f"candidates) in {time.perf_counter() - t2:.0f} s")
    dec: dict = {}
    both = replay_windows(env_w, params_w, wins, heur, learned, keys=keys, decisions=dec)
    per_train = {p: {m: v[:nt] for m, v in d.items()} for p, d in both.items()}
    per_eval = {p: {m: v[nt:] for m, v in d.items()} for p, d in both.items()}
    log(f"evaluated {len(heur) + len(learned)} policies on {len(wins)} windows in "
        f"{time.perf_counter() - t1:.0f} s")

    seed_names = list(learned)
    for pw in (per_train, per_eval):
        pw[label] = {m: np.mean([pw[s][m] for s in seed_names], axis=0) for m in METRICS}
    best, sel_values = select_best(per_train, names)
    kw = dict(metrics=METRICS, higher_better=HIGHER_BETTER)
    paired = study.compare(per_eval, seed_names, names, **kw)
    paired += study.compare_seeds(per_eval, seed_names, names, label=label, **kw)
    head = [r for r in paired if r["baseline"] == best and r["metric"] == HEADLINE]
    summary = {k: {p: {m: float(np.nanmean(v)) for m, v in d.items()} for p, d in pw.items()}
               for k, pw in (("eval", per_eval), ("train", per_train))}
    t = wl["train_trace"].trace
    return {
        "config": dict(workload=workload, load=float(load), algo=algo, seeds=seeds,
                       total_steps=int(total_steps), eval_windows=int(eval_windows),
                       train_windows=nt, window_requests=int(window_requests),
                       fit_fraction=float(fit_fraction), heuristics=names,
                       tuned=tuned,
                       ppo_overrides=dict(ppo_overrides or {}), eval_seed=int(eval_seed),
                       slo_ttft_s=float(params.slo_ttft_s), slo_tpot_s=float(params.slo_tpot_s),
                       drop_penalty_s=float(params.drop_penalty_s)),
        "workload": {"rate": wl["rate"], "factor": wl["factor"], "capacity": wl["capacity"],
                     "basis": wl["basis"], "calibration": wl["calibration"],
                     "windows": wl["windows"], "never_fit": wl["never_fit"],
                     "train_requests": len(t), "train_span_s": float(t.arrival_s[-1]),
                     "kv_blocks": int(params.gpus.kv_blocks[0]),
                     "block_size": int(params.gpus.block_size[0])},
        "training": {"seeds": seeds, **training},
        "per_window": {k: {p: {m: np.asarray(v).tolist() for m, v in d.items()}
                           for p, d in pw.items()}
                       for k, pw in (("eval", per_eval), ("train", per_train))},
        "summary": summary,
        "selection": {"on": "training windows", "metric": HEADLINE, "values": sel_values,
                      "best": best},
        "headline": {"best_heuristic": best, "learned": label,
                     label: next(r for r in head if r["learned"] == label),
                     "per_seed": [r for r in head if r["learned"] != label]},
        "paired": paired,
        "routing": {name: cache_use(d["follows"][nt:], d["load_ratio"][nt:])
                    for name, d in dec.items()},
        "seconds": time.perf_counter() - t0,
        **({"policies": learned} if keep_policies else {}),
    }


# Bins of the most-cached replica's load (tokens in flight over the replicas' mean) for
# `cache_use`'s "leaves the cache" rates.
LOAD_BINS = (0.0, 1.0, 1.5, 2.0, np.inf)


def cache_use(follows, load_ratio) -> dict:
    """How a router uses the cache, over all its decisions (`(W, n)` arrays of
    `replay_windows(..., decisions=)`): `follows_most_cached`, the share of requests sent
    where `most_cached` would send them; `load_ratio_followed` / `load_ratio_left`, the mean
    load of that replica (over the mean) when it did / did not (None without such
    decisions); and per `LOAD_BINS` bin of that load, the decisions and the share that left
    it (`leave_share`, None for an empty bin)."""
    f = np.asarray(follows, bool).ravel()
    r = np.asarray(load_ratio, np.float64).ravel()
    mean = lambda x: float(x.mean()) if x.size else None  # noqa: E731
    bins = []
    for lo, hi in zip(LOAD_BINS[:-1], LOAD_BINS[1:]):
        inside = (r >= lo) & (r < hi)
        bins.append({"low": lo, "high": hi if np.isfinite(hi) else None,  # JSON: no inf
                     "decisions": int(inside.sum()),
                     "leave_share": mean(~f[inside])})
    return {"follows_most_cached": float(f.mean()), "load_ratio_followed": mean(r[f]),
            "load_ratio_left": mean(r[~f]), "decisions": int(f.size), "by_load": bins}


# ------------------------------------------------------------------------------ formatting

# The columns of the tables, in order: metric -> (label, format).
COLUMNS = {HEADLINE: ("time in system (s)", ".2f"), "ttft_p50": ("TTFT p50 (s)", ".2f"),
           "ttft_p99": ("TTFT p99 (s)", ".1f"), "slo_attainment": ("SLO attainment", ".3f"),
           "goodput": ("goodput (req/s)", ".3f"), "token_hit_rate": ("token hit rate", ".3f"),
           "dropped": ("drops", ".1f"), "preemptions": ("preemptions", ".1f")}
DIFF_COLUMNS = (HEADLINE, "ttft_p50", "ttft_p99", "goodput", "token_hit_rate")


def verdict(row: dict) -> str:
    """"learned better" / "learned worse" where the 95% interval excludes 0, else "no
    significant difference"."""
    return ("learned better" if row["learned_better"] else "learned worse"
            if row["learned_worse"] else "no significant difference")


def ci_text(row: dict, fmt: str = "+.3g") -> str:
    """`mean [low, high]` of a comparison row."""
    return f"{row['mean']:{fmt}} [{row['low']:{fmt}}, {row['high']:{fmt}}]"


def result_label(result: dict) -> str:
    """The learned seeds' joint label of a result ("ppo_mean"; results written before
    REINFORCE joined the study have no `headline.learned` and are PPO's)."""
    return result["headline"].get("learned", LEARNED)


def format_prefix_study(result: dict) -> str:
    """Markdown: the learned router against the best heuristic (chosen on the training
    windows), every policy's mean metrics over the evaluation windows, and the seeds'
    paired differences against every heuristic."""
    head = result["headline"]
    best = head["best_heuristic"]
    learned = result_label(result)
    sel = result["selection"]["values"]
    ev, tr = result["summary"]["eval"], result["summary"]["train"]
    seeds = [r["learned"] for r in head["per_seed"]]
    per_seed = "; ".join(f"`{r['learned']}` {ci_text(r)} ({verdict(r)})" for r in head["per_seed"])
    lines = [
        f"**Learned vs the best heuristic.** The best heuristic on the training "
        f"window{'s' if result['config']['train_windows'] > 1 else ''} (lowest mean time in "
        f"system there, {sel[best]:.2f} s) is `{best}`. `{learned}` (the {len(seeds)} seeds' "
        f"greedy policies) minus `{best}` on the {result['config']['eval_windows']} "
        f"evaluation windows, mean time in system: **{ci_text(head[learned])} s** (crossed seed "
        f"x window bootstrap, 95%): **{verdict(head[learned])}**. Per seed (paired t over "
        f"windows): {per_seed}.",
        *tuned_lines(result),
        "",
        "| policy | time in system, training (s) | " + " | ".join(
            label for label, _ in COLUMNS.values()) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in COLUMNS) + " |"]
    heur = sorted((p for p in ev if p in sel), key=lambda p: ev[p][HEADLINE])
    for p in [learned, *seeds, *heur]:
        name = f"`{p}`" + (" (best on training)" if p == best else "")
        lines.append(f"| {name} | {tr[p][HEADLINE]:.2f} | " + " | ".join(
            f"{ev[p][m]:{f}}" for m, (_, f) in COLUMNS.items()) + " |")
    rows = {(r["baseline"], r["metric"]): r for r in result["paired"]
            if r["learned"] == learned}
    lines += ["", f"`{learned}` minus each heuristic on the evaluation windows (mean [95% "
              "interval], crossed seed x window bootstrap; \\* marks an interval that excludes "
              "0, + better or - worse for the learned router):", "",
              "| heuristic | " + " | ".join(COLUMNS[m][0] for m in DIFF_COLUMNS) + " |",
              "| --- | " + " | ".join("---:" for _ in DIFF_COLUMNS) + " |"]
    for h in heur:
        cells = []
        for m in DIFF_COLUMNS:
            r = rows[(h, m)]
            mark = " \\*+" if r["learned_better"] else " \\*-" if r["learned_worse"] else ""
            cells.append(ci_text(r) + mark)
        lines.append(f"| `{h}` | " + " | ".join(cells) + " |")
    if "routing" in result:  # results written before 2026-12-05 (late) lack it
        lines += ["", *format_cache_use(result["routing"], [*seeds, *heur])]
    return "\n".join(lines)


# What each fitted router is (markdown), and its published default on the grid, if any.
_TUNED_TEXT = {
    TUNED_LLMD: ("llm-d's weighted scorers with the weights (queue, KV cache, prefix) that do "
                 "best", PR.LLMD_DEFAULT, "(2, 2, 3)"),
    TUNED_GUARD: ("`most_cached` with the load guard (the cached replica's tokens in flight "
                  "over the mean) that does best", None, ""),
    TUNED_SGLANG: ("SGLang's `cache_aware` with the thresholds (cache, balance absolute, "
                   "balance relative) that do best", PR.SGLANG_DEFAULT, "(0.3, 64, 1.5)"),
    TUNED_AIBRIX: ("AIBrix's `prefix-cache` with the thresholds (imbalance absolute, "
                   "standard-deviation factor) that do best", PR.AIBRIX_DEFAULT, "(8, 1)"),
}


def tuned_lines(result: dict) -> list[str]:
    """Markdown: what the fitted heuristics (`llmd_tuned`, `guarded_tuned`, `sglang_tuned`,
    `aibrix_tuned`) were fitted to, for those the result has."""
    tuned = result["config"].get("tuned", {})
    lines = []
    for name, fit in tuned.items():
        ranked = sorted(fit["grid"], key=lambda r: r[1])
        runners = ", ".join(f"{fmt_weights(w)} {v:.2f} s" for w, v in ranked[1:3])
        what, default_w, default_txt = _TUNED_TEXT[name]
        default = [v for w, v in fit["grid"]
                   if default_w is not None and tuple(w) == tuple(map(float, default_w))]
        tail = f"; the default {default_txt}: {default[0]:.2f} s" if default else ""
        lines += ["", f"`{name}` is {what} on the training windows among "
                  f"{len(fit['grid'])} values tried: **{fmt_weights(fit['weights'])}**, "
                  f"{fit['value']:.2f} s there (next: {runners}{tail})."]
    return lines


def plot_cache_use(result: dict, path) -> Path:
    """Two panels of one (workload, load) result, written to `path` (PNG): left, every policy's
    token hit rate against its mean time in system on the evaluation windows (the trade-off
    between cache affinity and load; the learned seeds as filled circles); right, the share
    of decisions that leave `most_cached`'s replica by that replica's load (`cache_use`),
    for the learned seeds, the best heuristic and `most_cached`'s load-guarded rivals."""
    ev = result["summary"]["eval"]
    best = result["headline"]["best_heuristic"]
    seeds = [r["learned"] for r in result["headline"]["per_seed"]]
    routing = result.get("routing", {})
    with axes_row(path, ncols=2 if routing else 1, figsize=(12, 4.6)) as (fig, axes):
        ax = axes[0]
        for name, m in ev.items():
            if name == result_label(result):
                continue
            learned = name in seeds
            ax.scatter(m["token_hit_rate"], m[HEADLINE], s=40 if learned else 28,
                       marker="o" if learned else "s", color="C3" if learned else
                       ("C0" if name == best else "0.5"), zorder=3 if learned else 2)
            if not learned:
                ax.annotate(name, (m["token_hit_rate"], m[HEADLINE]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("token hit rate (evaluation windows)")
        ax.set_ylabel("mean time in system, drops at penalty (s)")
        ax.set_title(f"{result['config']['workload']}, load {result['config']['load']:g}: "
                     f"learned (red) vs routers (best on training: blue)", fontsize=9)
        ax.grid(alpha=0.3)
        if routing:
            ax = axes[1]
            others = [best] + [n for n in ("llmd_scorers", "sglang_cache_aware",
                                           "aibrix_prefix_cache") if n != best and n in routing]
            bins = routing[seeds[0]]["by_load"]
            labels = [f"{b['low']:g}-{b['high']:g}x" if b["high"] is not None
                      else f">={b['low']:g}x" for b in bins]
            share = lambda n: np.array([np.nan if b["leave_share"] is None  # noqa: E731
                                        else b["leave_share"] for b in routing[n]["by_load"]])
            per_seed = np.array([share(n) for n in seeds])  # (seeds, bins)
            groups = [(f"learned ({len(seeds)} seeds: mean, range)", np.nanmean(per_seed, 0),
                       per_seed, "C3")] + [(n, share(n), None, c)  # C3 is the learned
                                           for n, c in zip(others, ("C0", "C1", "C2", "C4"))]
            width = 0.8 / len(groups)
            x = np.arange(len(bins))
            for j, (label, y, spread, color) in enumerate(groups):
                err = None
                if spread is not None and len(seeds) > 1:
                    # floored at 0: the mean of equal shares can round past their min/max
                    err = np.maximum(np.vstack([y - np.nanmin(spread, 0),
                                                np.nanmax(spread, 0) - y]), 0.0)
                ax.bar(x + (j - (len(groups) - 1) / 2) * width, y, width, yerr=err,
                       label=label, color=color, capsize=2)
            ax.set_xticks(x, labels)
            ax.set_xlabel("load of most_cached's replica (tokens in flight / replicas' mean)")
            ax.set_ylabel("share of decisions sent elsewhere")
            ax.set_title("when a router leaves the most-cached replica", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3, axis="y")
    return Path(path)


def format_cache_use(routing: dict, order: Sequence[str]) -> list[str]:
    """Markdown lines: how each policy of `order` uses the cache (`cache_use`)."""
    opt = lambda x, f: "-" if x is None else f"{x:{f}}"  # noqa: E731
    bins = next(iter(routing.values()))["by_load"]
    heads = [f"{b['low']:g}-{b['high']:g}x" if b["high"] is not None else f">= {b['low']:g}x"
             for b in bins]
    lines = ["How each policy uses the cache, over the evaluation windows' decisions: the "
             "share of requests sent where `most_cached` (most cached prefix blocks, then "
             "fewest tokens in flight) sends them, the load of that replica (tokens in "
             "flight over the replicas' mean, before the decision) when the policy follows "
             "it and when it does not, and the share of decisions that leave it by that "
             "load (decisions in brackets):", "",
             "| policy | follows `most_cached` | its load when followed | its load when left | "
             + " | ".join(f"leaves it at {h}" for h in heads) + " |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in heads) + " |"]
    for name in order:
        u = routing[name]
        lines.append(f"| `{name}` | {u['follows_most_cached']:.3f} | "
                     f"{opt(u['load_ratio_followed'], '.2f')} | "
                     f"{opt(u['load_ratio_left'], '.2f')} | " + " | ".join(
                         f"{opt(b['leave_share'], '.3f')} ({b['decisions']})"
                         for b in u["by_load"]) + " |")
    return lines
