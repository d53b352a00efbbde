"""PPO against the LLMRouting-v0 heuristics on an Azure LLM trace (docs/results.md, section (f)).

The experiment, end to end (`run_study`):

1. The trace (Azure LLM 2023 conversation or code) is split by `core.sources.split_trace`:
   the first `fit_fraction` of its requests is the *training* window, the rest the
   *evaluation* window; nothing is trained, fitted or tuned on the evaluation window.
2. Load: time is stretched by one factor so that the training window's mean rate is `load`
   times the cluster's capacity; the same factor rescales the evaluation window. The
   capacity is, by `load_basis`, either *measured* ("attainment", the default): the highest
   rate at which `CALIBRATION_POLICY` (JSQ by tokens) replaying the training window keeps
   `CALIBRATION_TARGET` of its light-load SLO attainment (`measured_capacity`, bisection on
   the time stretch; training data only), or *nominal*: full-batch throughput at the
   training window's mean token sizes (`core.continuous_load.capacity`). The nominal figure
   ignores burstiness: the Azure code trace's inter-arrival times have a coefficient of
   variation of ~14 (45% under 10 ms), and at 0.8 x its nominal capacity JSQ by tokens
   drops half of the training window.
3. Training: PPO (`agents.train`, the registered LLMRouting-v0 with the study's cluster) on
   synthetic arrivals: a 2-phase MMPP fitted to the rescaled training window
   (`traces.fitting.fit_mmpp`) and its empirical (prompt, output) rows. SITA's prompt
   threshold is the training window's median prompt.
4. Evaluation: the evaluation window is cut into `eval_windows` consecutive windows of
   `window_requests` requests; every policy replays every window (`jaxserve.replay`), so the
   comparisons are paired on the same requests (common random numbers). Per window:
   TTFT / TPOT / E2E p50 and p99, SLO attainment and goodput (`evaluation.llm_metrics`),
   drops, preemptions (how hard KV memory binds), mean E2E with drops charged
   `drop_penalty_s`. Learned minus each heuristic, per seed: Student-t CIs of the paired
   per-window differences (`core.stats.paired_difference`); the seeds together ("ppo_mean"):
   the crossed seed x window bootstrap of the paired differences
   (`core.stats.seed_env_bootstrap`), so the interval counts training-seed and window noise.

`run_study` returns a JSON-able dict; `format_study` renders it as markdown tables.
`scripts/llm_routing.py` is the CLI.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import agents
import jaxserve
from jaxserve.core import arrivals as A
from jaxserve.core.continuous_load import capacity
from jaxserve.core.replica import replica_profile, stack_replicas
from jaxserve.core.sources import split_trace
from jaxserve.core.stats import paired_difference, seed_env_bootstrap
from jaxserve.core.types import Trace
from jaxserve.evaluation.llm_metrics import request_metrics, slo_attainment
from jaxserve import policies as P
from jaxserve.policies.llm_routing import make_sita_prompt
from jaxserve.traces import load, resolve
from jaxserve.traces.fitting import fit_mmpp

DEFAULT_TRACE = "conv"
TRACE_FILES = {"conv": "azure_llm_2023_conv",  # `jaxserve.traces.registry` names
               "code": "azure_llm_2023_code"}
# Heuristics compared: every registered LLMRouting-v0 router (kind "llm_routing") but
# `random` (read from the registry, so a router registered there is in the study;
# `least_marginal`, the greedy policy of the shaping potential, measured strongest on
# LLMRouting-v0's defaults). SITA gets its threshold from the training window.
HEURISTICS = tuple(n for n in P.names("llm_routing") if n != "random")
METRICS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99",
           "slo_attainment", "goodput", "dropped", "preemptions", "e2e_mean_drop_charged")
# The measured capacity (`measured_capacity`): the reference router, the share of its
# light-load SLO attainment it must keep, and the light load (a fraction of nominal capacity).
CALIBRATION_POLICY = "jsq_tokens"
CALIBRATION_TARGET = 0.9
LIGHT_LOAD = 1 / 64
# Higher is better for these; lower for the rest.
HIGHER_BETTER = ("slo_attainment", "goodput")


def study_replicas(max_seqs: int = 16, queue_cap: int = 16):
    """The study's cluster: two `opt13b-a100-80g` and two `opt13b-a100-40g` replicas (the
    registered default's mix) with `max_seqs` / `queue_cap` reduced to keep CPU training to
    minutes."""
    kw = dict(max_seqs=max_seqs, queue_cap=queue_cap)
    return ([replica_profile("opt13b-a100-80g", **kw)] * 2
            + [replica_profile("opt13b-a100-40g", **kw)] * 2)


def load_trace(name: str, traces_dir=None):
    """The Azure LLM 2023 trace `name` ("conv" or "code"): from `traces_dir` (a folder laid
    out like the trace mirror) if given, else `jaxserve.traces.path` (`$JAXSERVE_TRACES_DIR`,
    then the user cache). A missing file raises a ValueError (`TraceNotFoundError`) naming
    `jaxserve-traces fetch NAME`."""

    if name not in TRACE_FILES:
        raise ValueError(f"trace must be one of {sorted(TRACE_FILES)}, got {name!r}")
    return load(resolve(TRACE_FILES[name], traces_dir))


def _scale(trace, f: float):
    a = np.asarray(trace.arrival_s, np.float64)
    return Trace(arrival_s=(a - a[0]) * f, prompt_tokens=trace.prompt_tokens,
                 output_tokens=trace.output_tokens)


def prepare(trace, replicas, load: float, fit_fraction: float = 0.25,
            capacity_rps: float | None = None) -> dict:
    """Splits, rescales and fits (steps 1-3 of the module docstring).

    `capacity_rps` (req/s) is the capacity `load` is a fraction of; None: the nominal one.

    Returns:
      dict: `train` and `eval` traces (rescaled), `factor` (time stretch), `rate` (req/s of
      the rescaled training window), `capacity` (the req/s `load` is relative to),
      `nominal_capacity` (full-batch req/s of the cluster at the training window's mean
      sizes), `arrivals` (fitted MMPP), `tokens` (empirical rows of the training window),
      `sita_threshold`.
    """


    if not 0 < float(load):
        raise ValueError(f"load must be > 0, got {load}")
    fit, scored = split_trace(trace, fit_fraction)
    span = float(fit.arrival_s[-1] - fit.arrival_s[0])
    rate0 = (len(fit) - 1) / span
    p, o = float(fit.prompt_tokens.mean()), float(fit.output_tokens.mean())
    nominal = float(jnp.sum(capacity(stack_replicas(replicas), p, o)))
    if capacity_rps is not None and not float(capacity_rps) > 0:
        raise ValueError(f"capacity_rps must be > 0, got {capacity_rps}")
    cap = nominal if capacity_rps is None else float(capacity_rps)
    factor = rate0 / (float(load) * cap)
    train, ev = _scale(fit, factor), _scale(scored, factor)
    return {"train": train, "eval": ev, "factor": factor, "rate": rate0 / factor,
            "capacity": cap, "nominal_capacity": nominal, "arrivals": fit_mmpp(train).arrivals,
            "tokens": A.empirical_tokens(train.prompt_tokens, train.output_tokens),
            "sita_threshold": float(np.median(train.prompt_tokens))}


def measured_capacity(env, params, train, policy, *, slo_ttft: float, slo_tpot: float,
                      target: float = CALIBRATION_TARGET, light_load: float = LIGHT_LOAD,
                      iters: int = 10, key=None) -> dict:
    """The highest arrival rate (req/s) at which `policy` replaying the trace `train`, its
    time stretched by one factor, keeps `target` x its SLO attainment at a light load.

    The light load is the rate `light_load` x the trace's own rate. Bisection over the log of
    the stretch between the trace as given and the light load: `iters` replays after the two
    ends, so the stretch is found to a ratio of `(1 / light_load) ** (2 ** -iters)` (0.4% at
    the defaults). It assumes attainment does not fall as the rate falls (true of every
    router here on the traces we ran, not a theorem); if the trace as given already attains
    the target, its own rate is returned (`bracketed` False).

    Returns:
      dict: `capacity` (req/s), `attainment` there, `light_attainment`, `target_attainment`,
      `stretch` (time factor from `train` to the capacity), `bracketed`, `replays`.
    """


    if not 0 < target <= 1 or not 0 < light_load < 1:
        raise ValueError(f"target must be in (0, 1] and light_load in (0, 1), got {target}, "
                         f"{light_load}")
    a = np.asarray(train.arrival_s, np.float64)
    a = a - a[0]
    rate = (len(a) - 1) / a[-1]
    key = jax.random.PRNGKey(0) if key is None else key

    def attainment(stretch: float) -> float:
        tr = Trace(arrival_s=a * stretch, prompt_tokens=train.prompt_tokens,
                   output_tokens=train.output_tokens)
        res = jaxserve.replay(env, params, tr, policy=policy, key=key)
        return slo_attainment(res, tr.output_tokens, slo_ttft, slo_tpot)["attainment"]

    return bisect_capacity(attainment, rate, target=target, light_load=light_load,
                           iters=iters)


def bisect_capacity(attainment, rate: float, *, target: float = CALIBRATION_TARGET,
                    light_load: float = LIGHT_LOAD, iters: int = 10) -> dict:
    """`measured_capacity`'s search over `attainment(stretch)` (the SLO attainment with the
    trace's time stretched by `stretch`, rate `rate / stretch`); same return value."""
    light = float(attainment(1.0 / light_load))
    goal = target * light
    lo, hi = 0.0, float(np.log(1.0 / light_load))  # log stretch: lo fails, hi attains
    at_lo = float(attainment(1.0))
    if at_lo >= goal:
        return {"capacity": float(rate), "attainment": at_lo, "light_attainment": light,
                "target_attainment": goal, "stretch": 1.0, "bracketed": False, "replays": 2}
    at_hi = light
    for _ in range(int(iters)):
        mid = 0.5 * (lo + hi)
        at = float(attainment(float(np.exp(mid))))
        if at >= goal:
            hi, at_hi = mid, at
        else:
            lo = mid
    stretch = float(np.exp(hi))
    return {"capacity": float(rate / stretch), "attainment": at_hi, "light_attainment": light,
            "target_attainment": goal, "stretch": stretch, "bracketed": True,
            "replays": 2 + int(iters)}


def env_overrides(prep: dict, replicas, **extra) -> dict:
    """`jaxserve.make("LLMRouting-v0", **overrides)` for training on the fitted workload."""
    return {"replicas": list(replicas), "arrivals": prep["arrivals"], "tokens": prep["tokens"],
            **extra}


def window_metrics(result: dict, output_tokens, *, slo_ttft: float, slo_tpot: float,
                   drop_penalty_s: float) -> dict:
    """The `METRICS` of one replayed window (s, fractions, req/s)."""
    m = request_metrics(result, output_tokens)
    slo = slo_attainment(result, output_tokens, slo_ttft, slo_tpot)
    dropped = np.asarray(result["dropped"], bool)

    def pct(x, q):
        x = x[np.isfinite(x)]
        return float(np.percentile(x, q)) if x.size else float("nan")

    e2e_charged = np.where(dropped, drop_penalty_s, m["e2e"])
    preempted = np.asarray(result.get("preemptions", np.zeros(dropped.shape)), np.float64)
    return {"ttft_p50": pct(m["ttft"], 50), "ttft_p99": pct(m["ttft"], 99),
            "tpot_p50": pct(m["tpot"], 50), "tpot_p99": pct(m["tpot"], 99),
            "e2e_p50": pct(m["e2e"], 50), "e2e_p99": pct(m["e2e"], 99),
            "slo_attainment": slo["attainment"], "goodput": slo["goodput"],
            "dropped": float(dropped.sum()), "preemptions": float(preempted[~dropped].sum()),
            "e2e_mean_drop_charged": float(e2e_charged.mean())}


def evaluate_policies(env, params, policies: dict, eval_trace, *, window_requests: int,
                      eval_windows: int, slo_ttft: float, slo_tpot: float, key=None) -> dict:
    """Replays consecutive windows of `eval_trace` under every policy (paired windows).

    Returns:
      dict: policy name -> metric -> `(eval_windows,)` numpy array.
    """


    n = int(window_requests)
    if n < 2 or eval_windows < 1 or n * eval_windows > len(eval_trace):
        raise ValueError(f"{eval_windows} windows of {n} requests do not fit the evaluation "
                         f"window ({len(eval_trace)} requests)")
    key = jax.random.PRNGKey(0) if key is None else key
    drop_s = float(np.asarray(params.drop_penalty_s))
    out = {name: {m: np.zeros(eval_windows) for m in METRICS} for name in policies}
    for w in range(eval_windows):
        sl = slice(w * n, (w + 1) * n)
        a = np.asarray(eval_trace.arrival_s[sl], np.float64)
        tr = Trace(arrival_s=a - a[0], prompt_tokens=eval_trace.prompt_tokens[sl],
                   output_tokens=eval_trace.output_tokens[sl])
        k = jax.random.fold_in(key, w)
        for name, pol in policies.items():
            res = jaxserve.replay(env, params, tr, policy=pol, key=k)
            vals = window_metrics(res, tr.output_tokens, slo_ttft=slo_ttft, slo_tpot=slo_tpot,
                                  drop_penalty_s=drop_s)
            for m, v in vals.items():
                out[name][m][w] = v
    return out


def compare(per_window: dict, learned: Sequence[str], baselines: Sequence[str], *,
            metrics: Sequence[str] = METRICS,
            higher_better: Sequence[str] = HIGHER_BETTER) -> list[dict]:
    """Paired differences (learned minus baseline) of every metric of `metrics`, with 95%
    Student-t CIs; a difference is "better" upward for the metrics of `higher_better`,
    downward for the others."""
    rows = []
    for ln in learned:
        for b in baselines:
            for m in metrics:
                d = paired_difference(per_window[ln][m], per_window[b][m])
                better = d["mean"] > 0 if m in higher_better else d["mean"] < 0
                rows.append({"learned": ln, "baseline": b, "metric": m, **d,
                             "learned_better": bool(d["significant"] and better),
                             "learned_worse": bool(d["significant"] and not better)})
    return rows


def compare_seeds(per_window: dict, seeds: Sequence[str], baselines: Sequence[str],
                  label: str = "ppo_mean", *, metrics: Sequence[str] = METRICS,
                  higher_better: Sequence[str] = HIGHER_BETTER) -> list[dict]:
    """Paired differences (learned minus baseline) of every metric of `metrics` for several
    learned policies together (`seeds`: their names in `per_window`): the mean over seeds and
    windows with the crossed seed x window bootstrap's 95% interval
    (`core.stats.seed_env_bootstrap`), rows named `label`, in `compare`'s form."""
    rows = []
    for b in baselines:
        for m in metrics:
            d = np.stack([np.asarray(per_window[n][m], np.float64)
                          - np.asarray(per_window[b][m], np.float64) for n in seeds])
            r = seed_env_bootstrap(d)
            better = r["mean"] > 0 if m in higher_better else r["mean"] < 0
            significant = bool(r["low"] > 0 or r["high"] < 0)
            rows.append({"learned": label, "baseline": b, "metric": m, "mean": r["mean"],
                         "ci": r["ci"], "low": r["low"], "high": r["high"],
                         "n": int(d.size), "significant": significant,
                         "learned_better": bool(significant and better),
                         "learned_worse": bool(significant and not better)})
    return rows


def run_study(*, trace: str = DEFAULT_TRACE, load: float = 0.8, seeds: Sequence[int] = (0, 1, 2),
              total_steps: int = 100_000, num_envs: int = 16, fit_fraction: float = 0.25,
              window_requests: int = 400, eval_windows: int = 8, slo_ttft: float = 2.0,
              slo_tpot: float = 0.1, max_seqs: int = 16, queue_cap: int = 16,
              load_basis: str = "attainment", traces_dir=None, out_dir=None,
              log=print) -> dict:
    """Trains PPO (one run per seed) and evaluates it against `HEURISTICS` (module docstring).

    Args:
      trace: "conv" or "code" (Azure LLM 2023).
      load: offered load of the training window (its arrival rate / the capacity).
      load_basis: "attainment" (the capacity measured on the training window,
        `measured_capacity`) or "nominal" (`core.continuous_load.capacity` at mean sizes).
      seeds: PPO seeds; each trained policy is evaluated on the same windows.
      total_steps, num_envs: PPO budget (env steps) and parallel environments.
      window_requests, eval_windows: evaluation windows (consecutive, disjoint, all inside the
        evaluation part of the trace).
      slo_ttft, slo_tpot: the SLO (s, s/token) for attainment and goodput (choices, not
        measurements).
      max_seqs, queue_cap: replica limits of the study's cluster (`study_replicas`).
      out_dir: if given, each seed's training run (metrics.csv, checkpoints) goes to
        `out_dir/seed<k>`.

    Returns:
      JSON-able dict: `config`, `workload` (rate, capacity, factor, sizes), `training` (per
      seed: wall time, final return), `per_window` (policy -> metric -> list), `summary`
      (policy -> metric -> mean over windows), `paired` (learned minus heuristic, per seed and
      for the seeds' mean policy metrics), `seconds`.
    """

    t0 = time.perf_counter()
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    if load_basis not in ("attainment", "nominal"):
        raise ValueError(f"load_basis must be 'attainment' or 'nominal', got {load_basis!r}")
    replicas = study_replicas(max_seqs, queue_cap)
    raw = load_trace(trace, traces_dir)
    calibration = None
    if load_basis == "attainment":
        at_nominal = prepare(raw, replicas, 1.0, fit_fraction)
        env0, params0 = jaxserve.make("LLMRouting-v0", **env_overrides(at_nominal, replicas))
        calibration = measured_capacity(env0, params0, at_nominal["train"],
                                        P.get(CALIBRATION_POLICY, kind="llm_routing").fn,
                                        slo_ttft=slo_ttft, slo_tpot=slo_tpot)
        calibration["policy"] = CALIBRATION_POLICY
        prep = prepare(raw, replicas, load, fit_fraction,
                       capacity_rps=calibration["capacity"])
    else:
        prep = prepare(raw, replicas, load, fit_fraction)
    overrides = env_overrides(prep, replicas)
    env, params = jaxserve.make("LLMRouting-v0", **overrides)
    log(f"{trace}: training window {len(prep['train'])} requests, evaluation window "
        f"{len(prep['eval'])}; rate {prep['rate']:.3f} req/s = {load:g} x {load_basis} "
        f"capacity {prep['capacity']:.3f} req/s (nominal {prep['nominal_capacity']:.3f}; "
        f"time x {prep['factor']:.3f})")
    policies = {n: P.get(n, kind="llm_routing").fn for n in HEURISTICS if n != "sita_prompt"}
    policies["sita_prompt"] = make_sita_prompt(prep["sita_threshold"])
    training = []
    learned = []
    for s in seeds:
        run_dir = None if out_dir is None else f"{out_dir}/seed{s}"
        res = agents.train("LLMRouting-v0", overrides, "ppo", int(total_steps), seed=s,
                           num_envs=int(num_envs), out_dir=run_dir, progress=False)
        name = f"ppo_seed{s}"
        policies[name] = res.policy
        learned.append(name)
        training.append({"seed": s, "wall_time_s": res.wall_time_s,
                         "compile_time_s": res.compile_time_s,
                         "final_return": res.final_return()})
        log(f"seed {s}: trained {total_steps} steps in {res.wall_time_s:.0f} s, final return "
            f"{res.final_return():.3f}")
    per_window = evaluate_policies(env, params, policies, prep["eval"],
                                   window_requests=window_requests, eval_windows=eval_windows,
                                   slo_ttft=slo_ttft, slo_tpot=slo_tpot)
    # The seeds' mean: per window, the mean of the learned policies' metric values.
    if len(learned) > 1:
        per_window["ppo_mean"] = {m: np.mean([per_window[n][m] for n in learned], axis=0)
                                  for m in METRICS}
    heur = list(HEURISTICS)
    paired = compare(per_window, learned, heur)
    if len(learned) > 1:
        paired += compare_seeds(per_window, learned, heur, label="ppo_mean")
    summary = {n: {m: float(np.nanmean(v)) for m, v in d.items()} for n, d in per_window.items()}
    return {
        "config": dict(trace=trace, load=load, seeds=seeds, total_steps=total_steps,
                       num_envs=num_envs, fit_fraction=fit_fraction,
                       window_requests=window_requests, eval_windows=eval_windows,
                       slo_ttft=slo_ttft, slo_tpot=slo_tpot, max_seqs=max_seqs,
                       queue_cap=queue_cap, load_basis=load_basis),
        "workload": {"rate": prep["rate"], "capacity": prep["capacity"],
                     "nominal_capacity": prep["nominal_capacity"],
                     "calibration": calibration,
                     "factor": prep["factor"], "train_requests": len(prep["train"]),
                     "eval_requests": len(prep["eval"]),
                     "sita_threshold": prep["sita_threshold"]},
        "training": training,
        "per_window": {n: {m: v.tolist() for m, v in d.items()} for n, d in per_window.items()},
        "summary": summary,
        "paired": paired,
        "seconds": time.perf_counter() - t0,
    }


def format_study(result: dict) -> str:
    """Markdown: the policies' mean metrics over windows, then the paired differences of the
    learned policies (seeds' mean when several) against each heuristic."""
    s = result["summary"]
    lines = ["| policy | " + " | ".join(METRICS) + " |",
             "| --- | " + " | ".join("---" for _ in METRICS) + " |"]
    for name, d in s.items():
        lines.append(f"| {name} | " + " | ".join(f"{d[m]:.3g}" for m in METRICS) + " |")
    lines += ["", "| learned - baseline | metric | mean | 95% CI | verdict |",
              "| --- | --- | --- | --- | --- |"]
    names = {r["learned"] for r in result["paired"]}
    show = "ppo_mean" if "ppo_mean" in names else sorted(names)[0]
    for r in result["paired"]:
        if r["learned"] != show or r["metric"] not in ("ttft_p99", "e2e_p99", "slo_attainment",
                                                      "goodput", "e2e_mean_drop_charged"):
            continue
        verdict = ("learned better" if r["learned_better"] else
                   "learned worse" if r["learned_worse"] else "no significant difference")
        lines.append(f"| {show} - {r['baseline']} | {r['metric']} | {r['mean']:.3g} | "
                     f"[{r['low']:.3g}, {r['high']:.3g}] | {verdict} |")
    return "\n".join(lines)


def reproduce(quick: bool = False, **kw: Any) -> dict:
    """The docs/continuous.md experiment with its recorded settings (for scripts/reproduce.py);
    `quick=True`: one seed, 20k steps, 2 windows (a smoke run, not the result)."""
    if quick:
        kw = {"seeds": (0,), "total_steps": 20_000, "eval_windows": 2, **kw}
    return run_study(**kw)
