"""(f) Continuous batching: PPO routing LLM requests on an Azure trace (issue 12, item 6).

The experiment itself lives in `agents.experiments.llm_routing_study` (its module docstring
says how the trace is split, rescaled, trained on and evaluated on disjoint windows); this
module registers it with the budget's seeds. It is the slowest experiment on a CPU (the
continuous-batching step runs a scheduler per replica iteration), so the quick and tiny
budgets skip it unless it is asked for by name (`--only f`).
"""

from __future__ import annotations

from agents.experiments.common import Context, Section
from agents.experiments.registry import experiment
from agents.experiments import llm_routing_study as study

# Training steps per seed and evaluation windows per budget. "quick" is docs/continuous.md's
# CPU run (40k steps, where PPO lost to every heuristic); "full" gives PPO Routing-v0's budget.
STEPS = {"full": 500_000, "quick": 40_000, "tiny": 2048}
WINDOWS = {"full": 8, "quick": 6, "tiny": 2}


@experiment("f", "Continuous batching: learned LLM router vs the LLMRouting-v0 heuristics "
                 "(Azure conversation trace)")
def llm_routing(ctx: Context) -> Section:
    b = ctx.budget
    result = study.run_study(seeds=b.seeds, total_steps=STEPS[b.name],
                             eval_windows=WINDOWS[b.name], log=ctx.log)
    cfg = result["config"]
    body = (f"Command: `{ctx.command}`. Trace `{cfg.get('trace', study.DEFAULT_TRACE)}`, "
            f"nominal load {cfg.get('load')}, PPO seeds {list(b.seeds)} with "
            f"{STEPS[b.name]:,} steps each, trained on an MMPP fitted to the first part of the "
            f"trace and evaluated on {WINDOWS[b.name]} disjoint later windows (paired "
            "per-window differences, Student-t 95% CIs).\n\n" + study.format_study(result))
    return Section("(f) Continuous batching: learned LLM router vs heuristics", body,
                   data=result)
