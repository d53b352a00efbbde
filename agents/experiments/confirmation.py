"""Experiment (y): the confirmatory run of (x)'s pick, on training seeds and evaluation
streams it was not found on (the rule for a "win": a CI that counts seed and evaluation
noise excludes 0, on data other than the data that chose it).

(x) trains PPO variants on (w)'s short_bursts streams with seeds 0-7 and shows each one's
paired difference with `sita_tuned`; the variant with the lowest mean there, PPO without
reward shaping, was picked after looking at those numbers, so (x) cannot also be the
evidence for it. (y) fixes its protocol here, before it runs, and changes nothing after:
  - the variant: `CONFIRMED_VARIANT` (one row of `ablation.VARIANTS`, trained with (w)'s
    steps and hyperparameters);
  - training seeds `SEEDS[budget]`, disjoint from (x)'s and (w)'s;
  - evaluation streams of `ctx.eval_key(STREAMS_SALT)`, an index no other experiment uses,
    and `sita_tuned` fitted on the tuning streams of that key (`tuning_key`);
  - the statistic: (w)'s crossed seed x stream bootstrap of the paired difference;
  - each seed's policy is also distilled (`evaluation.distill`, on the tuning streams) and
    paired against its distilled rule.
Skipped by the quick and tiny budgets unless named (`--only y`): 16 seeds of 393k steps take
about 7 minutes on 2 CPU cores.
"""

from __future__ import annotations

from jaxserve.agents.experiments.ablation import HEURISTIC, SCENARIO, SEEDS as ABLATION_SEEDS
from jaxserve.agents.experiments.ablation import VARIANTS, run_ablation
from jaxserve.agents.experiments.common import LATENCY, Context, Section, env_mean, table
from jaxserve.agents.experiments.registry import experiment
from jaxserve.agents.experiments.routing_win import WIN_EVAL, clairvoyant
from jaxserve.envs.registry import make
from jaxserve.evaluation import evaluate_many

CONFIRMED_VARIANT = "ppo, no shaping"
# Disjoint from (x)'s seeds (`ablation.SEEDS`) and (w)'s, so the policies are new draws.
SEEDS = {"quick": tuple(range(8, 24)), "full": tuple(range(10, 30)), "tiny": (1,)}
# `ctx.eval_key` index of (y)'s streams: (a)-(x) use 1, 10-25, 30-50, 60 and 70-72.
STREAMS_SALT = 90


def protocol(budget_name: str) -> dict:
    """(y)'s fixed protocol for a budget: variant, heuristic, scenario, seeds, key index.
    Raises ValueError if the seeds overlap (x)'s (the confirmation would reuse its draws)."""
    seeds = SEEDS[budget_name]
    overlap = set(seeds) & set(ABLATION_SEEDS[budget_name])
    if overlap:
        raise ValueError(f"(y)'s seeds {sorted(overlap)} are (x)'s too: a confirmation "
                         "needs seeds the pick was not made on")
    return {"variant": CONFIRMED_VARIANT, "heuristic": HEURISTIC, "scenario": SCENARIO,
            "seeds": list(seeds), "streams_salt": STREAMS_SALT}


@experiment("y", "Confirmation: (x)'s pick on fresh seeds and fresh streams")
def confirmation(ctx: Context) -> Section:
    proto = protocol(ctx.budget.name)
    variant = next(v for v in VARIANTS if v[0] == proto["variant"])
    body, data = run_ablation(ctx, [variant], proto["seeds"], key_salt=proto["streams_salt"],
                              scenario=proto["scenario"], heuristic=proto["heuristic"],
                              experiment_key="y", distill=True)
    intro = (f"(x) picked `{proto['variant']}` after seeing its numbers on (w)'s streams; "
             "here it is trained again with seeds (x) did not use and evaluated on streams "
             "no other experiment uses, against "
             f"`{proto['heuristic']}` fitted on those streams' tuning streams. The protocol "
             "is fixed in `agents/experiments/confirmation.py` before the run; whichever "
             "way it falls, this is the result the summary reports for the pick.")
    data["protocol"] = proto
    # The clairvoyant references on (y)'s own streams: (w)'s are on other streams, and
    # a bound read off other streams would say nothing of these.
    env, params = make("Routing-v0", scenario=proto["scenario"])
    key = ctx.eval_key(proto["streams_salt"])
    exact, oracle = clairvoyant(env, params, key)
    eval_envs, eval_steps, warmup = WIN_EVAL[ctx.budget.name]
    ctx.log("  evaluating (y) clairvoyant references")
    res = evaluate_many(env, exact, oracle, key, eval_envs, eval_steps, warmup=warmup)
    lat = {n: env_mean(res[n]["per_env"][LATENCY]) for n in oracle}
    best = min(lat, key=lat.get)
    data["clairvoyant"] = {"name": best, "mean": lat[best]}
    body += ("\n\nClairvoyant references on these streams (not realisable: they read the true "
             "output lengths):\n\n" + table(["reference", "drop-incl. mean latency (s)"],
                                             [[n, f"{v:.3g}"] for n, v in lat.items()]))
    return Section("(y) Confirmation: (x)'s pick on fresh seeds and fresh streams",
                   intro + "\n\n" + body, data=data)
