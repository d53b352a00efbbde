"""Experiment (x): what the learned router's win in (w)'s short_bursts rests on (issue 25,
item 4: ablations of the estimate feature, the shaping and the network).

PPO is trained with (w)'s steps and hyperparameters, with more seeds (`SEEDS`), in four
variants, each changing one thing:
  - `ppo`: (w)'s run (set network, potential-based shaping, noisy estimate sigma 1);
  - `ppo, MLP`: the flat MLP of PureJaxRL (`network="mlp"`) instead of the set network;
  - `ppo, no shaping`: the unshaped time-in-system reward (`shaping_gamma=None`);
  - `ppo, uninformative estimate`: the output-length estimate drawn with lognormal sigma 4
    (`estimate_noise=4`, the largest allowed) in training and evaluation, so that it says
    almost nothing of the true length; arrivals and tokens are unchanged (the estimate has
    its own uniform), so the rows stay paired.
All variants and `sita_tuned` (fitted on tuning streams, as in (w)) route (w)'s evaluation
streams of short_bursts (the same key); statistics are (w)'s seed x stream bootstrap. The
share of short requests sent to the fast GPUs during bursts is (w)'s "why": the table shows
whether a variant still does it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from agents.experiments.common import (LATENCY, Context, Section, made_by, seed_names, table,
                                       train_scenarios)
from agents.experiments.registry import experiment
from agents.experiments.routing import routing_heuristics
from agents.experiments.routing_win import (WIN_BUDGETS, WIN_EVAL, WIN_TUNE, _interval,
                                            _to_fast_shares)

# Training seeds per budget name (steps per seed are (w)'s). More than (w)'s 3: at 3 seeds
# (w)'s short_bursts PPO scored 10.9 s in one training program and 12.0 s in another (same
# seeds and hyperparameters, other float rounding), a run-to-run spread as large as the
# differences measured here, which 3 seeds cannot show.
SEEDS = {"quick": tuple(range(8)), "full": tuple(range(10)), "tiny": (0,)}
from jaxserve.core.stats import seed_env_bootstrap
from jaxserve.envs.registry import ROUTING_SCENARIOS, make
from jaxserve.evaluation import evaluate_many
from jaxserve.policies.routing import gpu_speeds

SCENARIO = "short_bursts"
HEURISTIC = "sita_tuned"
# (label, what changes, environment keywords, training hyperparameters)
VARIANTS = (
    ("ppo", "nothing: (w)'s run", {}, {}),
    ("ppo, MLP", "flat MLP instead of the set network", {}, {"network": "mlp"}),
    ("ppo, no shaping", "unshaped time-in-system reward", {"shaping_gamma": None}, {}),
    ("ppo, uninformative estimate", "estimate noise sigma 4 instead of 1",
     {"estimate_noise": 4.0}, {}),
)


def _train_variants(seeds, steps, ctx) -> dict:
    """`{label: (env, params, [policy per seed])}`; variants that differ only in parameter
    values share one training program."""
    built = {lab: (make("Routing-v0", scenario=SCENARIO, **env_kw), hp)
             for lab, _, env_kw, hp in VARIANTS}
    groups: dict = {}
    for lab, ((env, _), hp) in built.items():
        groups.setdefault((env.shaping_gamma, tuple(sorted(hp.items()))), []).append(lab)
    out = {}
    for labs in groups.values():
        (env, _), hp = built[labs[0]]
        trained, _ = train_scenarios("Routing-v0", env, [built[lab][0][1] for lab in labs],
                                     "ppo", seeds, steps, ctx, **hp)
        for lab, pols in zip(labs, trained):
            # "ppo, MLP-s0": the seed names evaluation tables use.
            pols = [dataclasses.replace(p, name=f"{lab}-s{p.name.rsplit('-s', 1)[1]}")
                    for p in pols]
            out[lab] = (built[lab][0][0], built[lab][0][1], pols)
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if np.isfinite(x) else "none arrived"


@experiment("x", "Ablations: what the learned router's win in short_bursts rests on")
def ablation(ctx: Context) -> Section:
    b = ctx.budget
    seeds, steps = SEEDS[b.name], WIN_BUDGETS[b.name][1]
    eval_envs, eval_steps, warmup = WIN_EVAL[b.name]
    t_envs, t_steps, t_warm = WIN_TUNE[b.name]
    trained = _train_variants(seeds, steps, ctx)
    env, params, _ = trained["ppo"]
    # (w)'s key for this scenario, so the rows sit on (w)'s streams.
    key = ctx.eval_key(70 + list(ROUTING_SCENARIOS).index(SCENARIO))
    tune = dataclasses.replace(b, tune_envs=t_envs, tune_steps=t_steps, warmup=t_warm)
    heur = {HEURISTIC: routing_heuristics(env, params, key, tune)[HEURISTIC]}
    ctx.log(f"  evaluating (x) {len(VARIANTS)} variants")
    res: dict = {}
    by_params: dict = {}
    for lab, (_, p, pols) in trained.items():
        by_params.setdefault(float(np.asarray(p.estimate_noise)), (p, {}))[1].update(
            {pol.name: pol for pol in pols})
    for noise, (p, pols) in by_params.items():
        extra = heur if noise == float(np.asarray(params.estimate_noise)) else {}
        res.update(evaluate_many(env, p, {**pols, **extra}, key, eval_envs, eval_steps,
                                 warmup=warmup))
    speed = np.asarray(gpu_speeds(params))
    fast = speed >= speed.max() * (1 - 1e-6)
    base = np.stack([res[k]["per_env"][LATENCY] for k in seed_names(res, "ppo")])
    heur_lat = res[HEURISTIC]["per_env"][LATENCY]
    rows, data = [], {}
    for lab, what, _, _ in VARIANTS:
        names = seed_names(res, lab)
        lat = np.stack([res[k]["per_env"][LATENCY] for k in names])
        m = seed_env_bootstrap(lat)
        d_base = seed_env_bootstrap(lat - base) if lab != "ppo" else None
        d_heur = seed_env_bootstrap(lat - heur_lat[None])
        share = _to_fast_shares(res, names, fast)
        burst_short = share[1, 0] if share.shape[0] > 1 else np.nan
        rows.append([lab, what, f"{m['mean']:.3g} [{m['low']:.3g}, {m['high']:.3g}]",
                     " / ".join(str(int(res[k]["dropped"])) for k in names),
                     "" if d_base is None else _interval(d_base), _interval(d_heur),
                     _pct(burst_short)])
        data[lab] = {"mean": m["mean"], "low": m["low"], "high": m["high"],
                     "diff_vs_ppo": None if d_base is None else
                     {k: d_base[k] for k in ("mean", "low", "high")},
                     "diff_vs_heuristic": {k: d_heur[k] for k in ("mean", "low", "high")},
                     "burst_short_to_fast": float(burst_short)}
    hm = seed_env_bootstrap(heur_lat[None])
    hshare = _to_fast_shares(res, [HEURISTIC], fast)
    rows.append([HEURISTIC, "the best heuristic of (w), fitted on tuning streams",
                 f"{hm['mean']:.3g} [{hm['low']:.3g}, {hm['high']:.3g}]",
                 str(int(res[HEURISTIC]["dropped"])), "", "",
                 _pct(hshare[1, 0])])
    data[HEURISTIC] = {"mean": hm["mean"], "burst_short_to_fast": float(hshare[1, 0])}
    verdicts = []
    for lab, *_ in VARIANTS[1:]:
        d = data[lab]["diff_vs_ppo"]
        verdicts.append(f"{lab}: {_interval(d)} s against (w)'s PPO ("
                        + ("worse" if d["low"] > 0 else "better" if d["high"] < 0
                           else "no difference resolved") + ")")
    body = "\n\n".join([
        made_by(ctx, "x"),
        f"Scenario `{SCENARIO}` ((w)'s evaluation streams and key: {eval_envs} streams of "
        f"{eval_steps} requests, first {warmup} excluded). Each PPO variant changes one "
        f"thing and is trained with (w)'s steps and hyperparameters: {len(seeds)} seeds "
        f"(more than (w)'s, see below) of {steps} env steps each. Drop-"
        "inclusive mean latency (s) with the seed x stream 95% bootstrap CI; paired "
        "differences on the same streams. The last column is (w)'s \"why\": the share of "
        "short requests (true class) sent to a fastest GPU while a burst lasts. Why more "
        "seeds: (w)'s PPO on this scenario scored 10.9 s (a win over sita_tuned, paired -1.11 "
        "[-1.63, -0.46] s, commit 3c6a1c5) when trained in its own program and 12.0 s (no "
        "difference) when trained in one program with (w)'s other scenarios: the same seeds "
        "and hyperparameters, different float rounding. A 3-seed interval did not cover that "
        "spread.",
        table(["policy", "what changes", "drop-incl. mean latency (s)", "drops",
               "variant - ppo (s, paired, 95% CI)", f"variant - {HEURISTIC} (s, paired)",
               "short requests to fast GPUs in bursts"], rows),
        "Reading (measured above): " + "; ".join(verdicts) + "."])
    return Section("(x) Ablations: what the learned router's win in short_bursts rests on",
                   body, data=data)
