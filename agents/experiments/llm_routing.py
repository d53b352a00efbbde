"""(f) Continuous batching: PPO routing LLM requests on an Azure trace (docs/results.md,
section (f)).

The experiment itself lives in `agents.experiments.llm_routing_study` (its module docstring
says how the trace is split, rescaled, trained on and evaluated on disjoint windows); this
module registers it with the budget's seeds. It is the slowest experiment on a CPU (the
continuous-batching step runs a scheduler per replica iteration), so the quick and tiny
budgets skip it unless it is asked for by name (`--only f`).
"""

from __future__ import annotations

from jaxserve.agents.experiments.common import Context, Section
from jaxserve.agents.experiments.registry import experiment
from jaxserve.agents.experiments import llm_routing_study as study

# Training steps per seed and evaluation windows per budget. "quick" is docs/continuous.md's
# CPU budget (40k steps, ~20 s per seed on 2 CPU cores since the continuous engine's speed-up
# work, lab/history/benchmarks.md);
# "full" gives PPO Routing-v0's budget.
STEPS = {"full": 500_000, "quick": 40_000, "tiny": 2048}
WINDOWS = {"full": 8, "quick": 6, "tiny": 2}
# (trace, load) pairs per budget: both Azure LLM 2023 traces at 1.0 and 1.25 x the cluster's
# capacity measured on the training window (`llm_routing_study.measured_capacity`: the rate at
# which JSQ by tokens keeps 90% of its light-load SLO attainment), i.e. at the SLO's edge and
# beyond it, where routing decides attainment. Chosen before any run on this basis.
CONFIGS = {"full": (("conv", 1.0), ("code", 1.0), ("conv", 1.25), ("code", 1.25)),
           "quick": (("conv", 1.0), ("code", 1.0), ("conv", 1.25), ("code", 1.25)),
           "tiny": (("conv", 1.0),)}


@experiment("f", "Continuous batching: learned LLM router vs the LLMRouting-v0 heuristics "
                 "(Azure conversation and code traces)")
def llm_routing(ctx: Context) -> Section:
    b = ctx.budget
    parts, data = [], {}
    for trace, load in CONFIGS[b.name]:
        result = study.run_study(trace=trace, load=load, seeds=b.seeds,
                                 total_steps=STEPS[b.name], eval_windows=WINDOWS[b.name],
                                 log=ctx.log)
        data[f"{trace}@{load:g}"] = result
        w = result["workload"]
        parts.append(
            f"### Trace `{trace}`, load {load:g}\n\n"
            f"Rate {w['rate']:.3f} req/s = {load:g} x the measured capacity "
            f"{w['capacity']:.3f} req/s ({_calibration_text(w)}; nominal full-batch capacity "
            f"{w['nominal_capacity']:.3f} req/s; time x {w['factor']:.3f}); "
            f"{result['seconds']:.0f} s.\n\n"
            + study.format_study(result))
    body = (f"Command: `{ctx.command}`. PPO seeds {list(b.seeds)} with {STEPS[b.name]:,} steps "
            f"each, trained on an MMPP fitted to the first part of each trace and evaluated on "
            f"{WINDOWS[b.name]} disjoint later windows of it; learned minus heuristic: paired "
            "per-window differences, the seeds together (`ppo_mean`) with the crossed seed x "
            "window bootstrap's 95% interval, so it counts training-seed and window noise "
            "(with 6 windows the percentile bootstrap is coarse and can be narrow: read "
            "near-zero intervals with care). Load: a fraction of the capacity measured on "
            "the training window (the rate at which JSQ by tokens keeps 90% of its "
            "light-load SLO attainment), not of the nominal full-batch capacity, which "
            "ignores burstiness. `preemptions` (per window) shows where KV memory binds. "
            "The strongest "
            "heuristic is `least_marginal` (the greedy policy of the shaping potential) or "
            "`sita_prompt` (threshold fitted on the training window), whichever each table "
            "shows best.\n\n" + "\n\n".join(parts))
    return Section("(f) Continuous batching: learned LLM router vs heuristics", body, data=data)


def _calibration_text(workload: dict) -> str:
    cal = workload.get("calibration") or {}
    if not cal:
        return "nominal basis"
    return (f"{cal['policy']} attains {cal['attainment']:.3f} there, "
            f"{cal['light_attainment']:.3f} at a light load")
