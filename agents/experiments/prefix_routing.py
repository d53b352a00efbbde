"""Experiment (p): the learned prefix-cache-aware router against every router (the study of
docs/prefix_caching.md).

`agents.experiments.prefix_study` runs one (workload, load) configuration: PPO (the registered
environment's settings: ranked replicas, unshaped reward, PureJaxRL's MLP PPO) trained on the
workload's training trace, every production cache-aware router, the `most_cached` baseline and
every load-only router, all evaluated on disjoint later windows, learned minus the best
heuristic (chosen on the training windows) with the crossed seed x window bootstrap. This
module registers it with the budget's seeds. It is the slowest experiment on a CPU (the
prefix-caching engine runs an `O(M^2)` block lookup per admission, and Mooncake's long
prompts take many chunked-prefill iterations), so the quick and tiny budgets skip it unless
it is asked for by name (`--only p`).
"""

from __future__ import annotations

from jaxserve.agents.experiments import prefix_study as study
from jaxserve.agents.experiments.common import Context, Section
from jaxserve.agents.experiments.registry import experiment

# PPO env steps per seed, by budget and workload. "full" gives the 1M steps at which PPO
# reached llm-d's level on system_prompts (docs/prefix_caching.md; meant for a GPU); "quick"
# fitted the whole experiment in about 25 minutes on the shared 2-core CPU (measured
# 2026-12-05 with the set network of `prefix_study.SET_PPO`: ~390-650 env-steps/s on
# system_prompts and ~175-300 on Mooncake for three seeds together, each configuration
# compiling its training program for ~45-65 s; 1,513 s in all), far below the 1M steps PPO
# needs to match llm-d, so quick-budget verdicts say what PPO learns in that budget.
STEPS = {"full": {"system_prompts": 1_048_576, "mooncake": 1_048_576},
         "quick": {"system_prompts": 32_768, "mooncake": 16_384},
         "tiny": {"system_prompts": 2048, "mooncake": 2048}}
# Evaluation windows, tuning windows (the best heuristic is chosen and the fitted routers
# fitted on them: Mooncake's cut from its training part of 3,008 requests; system_prompts'
# the generator's seeds 0 to N - 1, seed 0 PPO's training trace) and requests per window
# (system_prompts: per generated trace; 512 is the environment's own episode).
WINDOWS = {"full": 8, "quick": 4, "tiny": 2}
TRAIN_WINDOWS = {"full": 5, "quick": 4, "tiny": 2}
WINDOW_REQUESTS = {"full": {"system_prompts": 512, "mooncake": 512},
                   "quick": {"system_prompts": 512, "mooncake": 256},
                   "tiny": {"system_prompts": 64, "mooncake": 64}}
# (workload, load) pairs per budget, fixed before any run: each workload at 1.0 and 1.5 x its
# base rate (system_prompts: the scenario's own 1.5 req/s; Mooncake: the capacity measured on
# its training windows, the rate at which JSQ by tokens keeps 90% of its light-load SLO
# attainment), i.e. where the registered scenario sits and half as much traffic again.
CONFIGS = {"full": (("system_prompts", 1.0), ("system_prompts", 1.5), ("mooncake", 1.0),
                    ("mooncake", 1.5)),
           "quick": (("system_prompts", 1.0), ("system_prompts", 1.5), ("mooncake", 1.0),
                     ("mooncake", 1.5)),
           "tiny": (("system_prompts", 1.0),)}


@experiment("p", "Prefix-cache-aware routing: learned router vs every production and "
                 "load-only router (system prompts, Mooncake conversation)")
def prefix_routing(ctx: Context) -> Section:
    b = ctx.budget
    data = {}
    for workload, load in CONFIGS[b.name]:
        data[f"{workload}@{load:g}"] = study.run_prefix_study(
            workload=workload, load=load, seeds=b.seeds, total_steps=STEPS[b.name][workload],
            eval_windows=WINDOWS[b.name], train_windows=TRAIN_WINDOWS[b.name],
            window_requests=WINDOW_REQUESTS[b.name][workload], eval_seed=ctx.eval_seed,
            log=ctx.log)
    return Section("(p) Prefix-cache-aware routing: learned router vs every router",
                   section_body(data, ctx.command), data=data)


def section_body(data: dict, command: str) -> str:
    """The section's markdown from its data (`{"workload@load": run_prefix_study result}`,
    also as read back from the results JSON): how it was run, the learned-vs-best summary
    of every configuration, then each configuration's tables."""
    rows, parts = [], []
    for result in data.values():
        c, head = result["config"], result["headline"]
        diff = head[study.result_label(result)]
        rows.append(f"| {c['workload']} | {c['load']:g} | `{study.result_label(result)}` | "
                    f"`{head['best_heuristic']}` | "
                    f"{study.ci_text(diff)} | {study.verdict(diff)} |")
        parts.append(f"### {c['workload']}, load {c['load']:g}\n\n{_workload_text(result)}"
                     "\n\n" + study.format_prefix_study(result))
    first = next(iter(data.values()))["config"]
    steps = ", ".join(dict.fromkeys(f"{r['config']['workload']} {r['config']['total_steps']:,}"
                                    for r in data.values()))
    return (
        f"Command: `{command}`. PPO (`agents.ppo` with LLMPrefixRouting-v0's settings on the "
        f"environment as registered: ranked replicas, unshaped reward) with seeds "
        f"{first['seeds']}, env steps per seed: {steps}; greedy policies. Every router of "
        "`policies.prefix_routing` (registry kind `prefix_routing`) at its published "
        "defaults, the routers fitted "
        "on the tuning windows (`prefix_study.fit_tuned`: `llmd_tuned`, llm-d's scorer "
        "weights; `guarded_tuned`, `most_cached` with a load guard; `sglang_tuned`, "
        "`aibrix_tuned`, SGLang's and AIBrix's thresholds; results written before "
        "2026-12-05 (night) lack them all, before 2026-12-06 (day) the last two), the "
        "`most_cached` baseline and every load-only router of `policies.llm_routing` "
        "(kind `llm_routing`; but `random`, and `sita_prompt`, which is `jsq_requests` on "
        "identical replicas). system_prompts: "
        "trained on the generator's seed-0 trace, tuned on the traces of seeds 0 to "
        f"{first['train_windows'] - 1}, evaluated on the traces of seeds 100, 101, "
        "...; Mooncake conversation: trained on its first 25% of requests, tuned on windows "
        "of that part, evaluated on disjoint windows spread over the rest. The best heuristic "
        "is the one with the lowest mean time in system on the tuning windows; learned minus "
        "heuristic on the "
        "evaluation windows, the seeds together (`ppo_mean`) with the crossed seed x window "
        f"bootstrap's 95% interval (with {first['eval_windows']} windows the percentile "
        "bootstrap is coarse: read near-zero intervals with care). Time in system is per "
        f"request, a drop counted at {first['drop_penalty_s']:g} s; SLO: TTFT <= "
        f"{first['slo_ttft_s']:g} s and TPOT <= {first['slo_tpot_s']:g} s/token.\n\n"
        "| workload | load | learned | best heuristic (training windows) | learned - best, "
        "time in system (s, 95% CI) | verdict |\n| --- | ---: | --- | --- | --- | --- |\n"
        + "\n".join(rows) + "\n\n" + "\n\n".join(parts))


def _workload_text(result: dict) -> str:
    """One paragraph: the configuration's rate, its basis, windows and wall time."""
    w, c = result["workload"], result["config"]
    cal = w.get("calibration")
    basis = (f"Rate {w['rate']:.4f} req/s = {c['load']:g} x the capacity "
             f"{w['capacity']:.4f} req/s measured on the training windows ({cal['policy']} "
             f"attains {cal['attainment']:.3f} of requests within the SLO there, "
             f"{cal['light_attainment']:.3f} at a light load)"
             if cal else f"Arrivals at {c['load']:g} x the scenario's rate ({w['capacity']:g} "
             f"sessions/s of one request each; the training trace's rate {w['rate']:.4f} "
             f"req/s)")
    never = sum(w["never_fit"])
    tr = result["training"]
    timing = ("networks trained earlier, evaluated again" if tr.get("trained_earlier") else
              f"compile {tr['compile_s']:.0f} s, run {tr['run_s']:.0f} s")
    return (f"{basis}; time x {w['factor']:.3f}. "
            f"{w['kv_blocks']} KV blocks of {w['block_size']} tokens per replica. "
            f"{c.get('algo', 'ppo').upper()} trained on {w['train_requests']} requests "
            f"(arrivals spanning {w['train_span_s']:.0f} s), {timing}; "
            f"{c['train_windows']} training and {c['eval_windows']} evaluation windows of "
            f"{c['window_requests']} requests"
            + (f" ({never} requests of the evaluation windows fit no replica's cache: dropped "
               f"by every router)" if never else "")
            + f"; {result['seconds']:.0f} s in all.")
