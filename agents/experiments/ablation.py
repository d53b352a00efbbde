"""Experiment (x): what the learned router's win in (w)'s short_bursts rests on (ablations of
the estimate feature, the shaping and the network; docs/results.md, section (x)).

PPO is trained with (w)'s steps and hyperparameters, with more seeds (`SEEDS`), in variants
that each change one thing:
  - `ppo`: (w)'s run (set network, potential-based shaping, noisy estimate sigma 1);
  - `ppo, MLP`: the flat MLP of PureJaxRL (`network="mlp"`) instead of the set network;
  - `ppo, no shaping`: the unshaped time-in-system reward (`shaping_gamma=None`);
  - `ppo, shaping gamma 1`: the shaping term `phi(s') - phi(s)` without the
    `(1 - gamma) * backlog` part the registered `shaping_gamma=0.99` adds each step;
  - `ppo, uninformative estimate`: the output-length estimate drawn with lognormal sigma 4
    (`estimate_noise=4`, the largest allowed) in training and evaluation, so that it says
    almost nothing of the true length; arrivals and tokens are unchanged (the estimate has
    its own uniform), so the rows stay paired.
All variants, `sita_tuned` (fitted on tuning streams, as in (w)) and `least_marginal` (the
greedy policy of the shaping potential) route (w)'s evaluation streams of short_bursts (the
same key); statistics are (w)'s seed x stream bootstrap. Two diagnostics say what each
variant does: the share of short requests sent to the fast GPUs during bursts ((w)'s "why"),
and how often `least_marginal` and `sita_tuned` would have made the variant's decisions
(`evaluation.agreement.action_agreement`, on the variant's own trajectories).

`python -m jaxserve.scripts.ablate` runs chosen variants with chosen seeds and evaluation
key outside `scripts/reproduce.py`: the confirmatory runs (fresh seeds, fresh streams) of a
difference found here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Sequence

import numpy as np

from jaxserve.agents.experiments.common import (LATENCY, Context, Section, made_by, seed_names, table,
                                       train_scenarios)
from jaxserve.agents.experiments.registry import experiment
from jaxserve.agents.experiments.routing import routing_heuristics
from jaxserve.agents.experiments.routing_win import (DISTILL_TAG, WIN_BUDGETS, WIN_EVAL, WIN_TUNE,
                                                     _interval, _to_fast_shares, distil_seeds,
                                                     speed_tiers)

# Training seeds per budget name (steps per seed are (w)'s). More than (w)'s 3: at 3 seeds
# (w)'s short_bursts PPO scored 10.9 s in one training program and 12.0 s in another (same
# seeds and hyperparameters, other float rounding), a run-to-run spread as large as the
# differences measured here, which 3 seeds cannot show.
SEEDS = {"quick": tuple(range(8)), "full": tuple(range(10)), "tiny": (0,)}

from jaxserve.agents.experiments.budget import BUDGETS
from jaxserve import policies  # noqa: E402
from jaxserve.core.stats import seed_env_bootstrap  # noqa: E402
from jaxserve.envs.registry import make  # noqa: E402
from jaxserve.envs.routing import ROUTING_SCENARIOS  # noqa: E402
from jaxserve.evaluation import evaluate_many  # noqa: E402
from jaxserve.evaluation.agreement import action_agreement  # noqa: E402
from jaxserve.policies.routing import gpu_speeds  # noqa: E402

SCENARIO = "short_bursts"
HEURISTIC = "sita_tuned"
GREEDY = "least_marginal"  # the greedy policy of the shaping potential
# (label, what changes, environment keywords, training hyperparameters)
VARIANTS = (
    ("ppo", "nothing: (w)'s run", {}, {}),
    ("ppo, MLP", "flat MLP instead of the set network", {}, {"network": "mlp"}),
    ("ppo, no shaping", "unshaped time-in-system reward", {"shaping_gamma": None}, {}),
    ("ppo, shaping gamma 1", "shaping without its (1 - gamma) x backlog part",
     {"shaping_gamma": 1.0}, {}),
    ("ppo, uninformative estimate", "estimate noise sigma 4 instead of 1",
     {"estimate_noise": 4.0}, {}),
)
# Not ablations of (w)'s run, so not in (x) itself: PPO started from a clone of the
# heuristic (`agents.imitation`), chosen with `scripts.ablate --variants`.
IMITATION_VARIANTS = (
    ("ppo, imitation warm start", "starts from a clone of the heuristic (agents.imitation)",
     {}, {"imitate": True}),
    ("ppo, imitation warm start, no shaping", "the clone's start, unshaped reward",
     {"shaping_gamma": None}, {"imitate": True}),
)
ALL_VARIANTS = VARIANTS + IMITATION_VARIANTS


def _train_variants(variants, seeds, steps, ctx, scenario: str = SCENARIO,
                    heuristic=None) -> tuple[dict, dict]:
    """`({label: (env, params, [policy per seed])}, {label: [clone per seed]})`; variants
    that differ only in parameter values share one training program; an imitation variant
    (`"imitate": True`) starts from a clone of `heuristic` (its own program) and its clones
    (the networks before PPO) are returned too."""
    built = {lab: (make("Routing-v0", scenario=scenario, **env_kw), dict(hp))
             for lab, _, env_kw, hp in variants}
    groups: dict = {}
    for lab, ((env, _), hp) in built.items():
        solo = (lab,) if hp.get("imitate") else ()
        groups.setdefault((env.shaping_gamma, tuple(sorted(hp.items())), solo), []).append(lab)
    out, clones = {}, {}
    for labs in groups.values():
        (env, _), hp = built[labs[0]]
        imitation = None
        if hp.pop("imitate", False):
            if heuristic is None:
                raise ValueError("an imitation variant needs the heuristic to imitate")
            imitation = {"policy": heuristic}  # imitation.DEFAULTS for the rest
        trained, curves = train_scenarios("Routing-v0", env,
                                          [built[lab][0][1] for lab in labs], "ppo", seeds,
                                          steps, ctx, imitation=imitation, **hp)

        def named(pols, lab, tag=""):
            # "ppo, MLP-s0": the seed names evaluation tables use.
            return [dataclasses.replace(p, name=f"{lab}{tag}-s{p.name.split('-s', 1)[1]}"
                                        .split("@")[0]) for p in pols]

        for i, lab in enumerate(labs):
            out[lab] = (built[lab][0][0], built[lab][0][1], named(trained[i], lab))
            if imitation is not None:
                clones[lab] = named(curves["imitation_policies"][i], lab, CLONE_TAG)
    return out, clones


CLONE_TAG = ": the clone, before PPO"
# The simple rules a distilled tree may use as leaves, beside the fitted heuristics and the
# greedy policy of the shaping potential (and a fixed GPU per leaf).
DISTILL_RULES = ("jsq", "least_work_left", "sed")


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if np.isfinite(x) else "none arrived"


def _agreement_cell(agree: dict, names, ref: str, phase: int) -> str:
    """Mean over a variant's seeds of the share of decisions `ref` would have made too."""
    vals = [agree[n][ref]["by_phase"][phase] for n in names]
    return _pct(float(np.mean(vals)))


def run_ablation(ctx: Context, variants=VARIANTS, seeds: Sequence[int] | None = None,
                 key_salt: int | None = None, scenario: str = SCENARIO,
                 heuristic: str = HEURISTIC, experiment_key: str = "x",
                 also: Sequence[str] = (), distill: bool = False) -> tuple[str, dict]:
    """Trains `variants` (`ALL_VARIANTS`' rows; the first is the baseline of the paired
    column) with `seeds` (default `SEEDS[budget]`), evaluates them beside `heuristic`
    (fitted on tuning streams of the evaluation key) and `least_marginal` on `scenario`, on
    the streams of `ctx.eval_key(key_salt)` ((w)'s for the scenario by default), and returns
    the markdown body and the numbers; `experiment_key` names the experiment in the
    provenance line; `also` names more registered routing heuristics (fitted alike) shown
    beside `heuristic`, each with its paired difference from it; with `distill`, each seed's
    learned policy is also distilled into a depth-2 tree of rules (`evaluation.distill`,
    fitted on the tuning streams) and evaluated beside it."""
    b = ctx.budget
    seeds = SEEDS[b.name] if seeds is None else tuple(int(x) for x in seeds)
    steps = WIN_BUDGETS[b.name][1]
    eval_envs, eval_steps, warmup = WIN_EVAL[b.name]
    t_envs, t_steps, t_warm = WIN_TUNE[b.name]
    # The heuristic, fitted on tuning streams of the base scenario, before training: an
    # imitation variant starts from a clone of it.
    base_env, base_params = make("Routing-v0", scenario=scenario)
    # (w)'s key for this scenario, so the rows sit on (w)'s streams.
    salt = 70 + list(ROUTING_SCENARIOS).index(scenario) if key_salt is None else key_salt
    key = ctx.eval_key(salt)
    tune = dataclasses.replace(b, tune_envs=t_envs, tune_steps=t_steps, warmup=t_warm)
    fitted = routing_heuristics(base_env, base_params, key, tune, names=(heuristic, *also))
    heur = {h: fitted[h] for h in (heuristic, *also)}
    heur[GREEDY] = policies.get(GREEDY, kind="routing")
    trained, clones = _train_variants(variants, seeds, steps, ctx, scenario, heur[heuristic])
    first = variants[0][0]
    env, params, _ = trained[first]
    ctx.log(f"  evaluating ({experiment_key}) {len(variants)} variant(s)")
    speed = np.asarray(gpu_speeds(params))
    fast = speed >= speed.max() * (1 - 1e-6)
    tiers = speed_tiers(params)
    distilled, trees = {}, {}
    if distill:
        ctx.log(f"  distilling ({experiment_key}) each seed's policy on tuning streams")
        rules = {**heur, **{n: policies.get(n, kind="routing") for n in DISTILL_RULES}}
        for lab, (env_l, p_l, pols_l) in trained.items():
            distilled[lab], trees[lab] = distil_seeds(env_l, p_l, pols_l, rules, key,
                                                      (t_envs, t_steps, t_warm), lab)
    res: dict = {}
    agree: dict = {}
    by_params: dict = {}
    for lab, (_, p, pols) in trained.items():
        by_params.setdefault(float(np.asarray(p.estimate_noise)), (p, {}))[1].update(
            {getattr(pol, "name", None) or pol.__name__: pol
             for pol in [*pols, *clones.get(lab, []), *distilled.get(lab, [])]})
    for noise, (p, pols) in by_params.items():
        extra = heur if noise == float(np.asarray(params.estimate_noise)) else {}
        res.update(evaluate_many(env, p, {**pols, **extra}, key, eval_envs, eval_steps,
                                 warmup=warmup))
        # The references read the variant's own estimate: they are asked, never scored.
        # Agreement on the GPU's speed tier: SITA picks the GPU inside a tier by least work
        # left, a detail that says nothing of where a policy sends which requests.
        agree.update(action_agreement(env, p, pols, heur, key, eval_envs, eval_steps,
                                      warmup=warmup, groups=tiers))
    base = np.stack([res[k]["per_env"][LATENCY] for k in seed_names(res, first)])
    heur_lat = res[heuristic]["per_env"][LATENCY]
    rows, data = [], {}
    labelled = [(lab, what) for lab, what, _, _ in variants]
    labelled += [(lab + CLONE_TAG, f"the network `{lab}` starts from: fitted to {heuristic}'s "
                  "decisions") for lab in clones]
    labelled += [(lab + DISTILL_TAG, f"`{lab}` distilled on tuning streams: reproduces "
                  f"{np.mean([t.agreement for t in trees[lab]]):.0%} of its decisions (the "
                  f"best single option {np.mean([t.best_single for t in trees[lab]]):.0%})")
                 for lab in distilled]
    for lab, what in labelled:
        names = seed_names(res, lab)
        lat = np.stack([res[k]["per_env"][LATENCY] for k in names])
        m = seed_env_bootstrap(lat)
        d_base = seed_env_bootstrap(lat - base) if lab != first else None
        d_heur = seed_env_bootstrap(lat - heur_lat[None])
        share = _to_fast_shares(res, names, fast)
        burst_short = share[1, 0] if share.shape[0] > 1 else np.nan
        rows.append([lab, what, f"{m['mean']:.3g} [{m['low']:.3g}, {m['high']:.3g}]",
                     " / ".join(str(int(res[k]["dropped"])) for k in names),
                     "" if d_base is None else _interval(d_base), _interval(d_heur),
                     _pct(burst_short)]
                    + [f"{_agreement_cell(agree, names, r, 0)} / "
                       f"{_agreement_cell(agree, names, r, 1)}" for r in (GREEDY, heuristic)])
        data[lab] = {"mean": m["mean"], "low": m["low"], "high": m["high"],
                     "diff_vs_ppo": None if d_base is None else
                     {k: d_base[k] for k in ("mean", "low", "high")},
                     "diff_vs_heuristic": {k: d_heur[k] for k in ("mean", "low", "high")},
                     "burst_short_to_fast": float(burst_short),
                     "agreement": {r: [float(np.mean([agree[n][r]["by_phase"][ph]
                                                      for n in names])) for ph in (0, 1)]
                                   for r in (GREEDY, heuristic)}}
    for h, what in ((heuristic, "fitted on tuning streams"),
                    *((a, "fitted on tuning streams") for a in also if a != heuristic),
                    (GREEDY, "the greedy policy of the shaping potential")):
        hm = seed_env_bootstrap(res[h]["per_env"][LATENCY][None])
        d = seed_env_bootstrap(res[h]["per_env"][LATENCY][None] - heur_lat[None])
        hshare = _to_fast_shares(res, [h], fast)
        rows.append([h, what, f"{hm['mean']:.3g} [{hm['low']:.3g}, {hm['high']:.3g}]",
                     str(int(res[h]["dropped"])), "", "" if h == heuristic else _interval(d),
                     _pct(hshare[1, 0]), "", ""])
        data[h] = {"mean": hm["mean"], "low": hm["low"], "high": hm["high"],
                   "burst_short_to_fast": float(hshare[1, 0])}
    verdicts = []
    for lab, _ in labelled[1:]:
        d = data[lab]["diff_vs_ppo"]
        verdicts.append(f"{lab}: {_interval(d)} s against {first} ("
                        + ("worse" if d["low"] > 0 else "better" if d["high"] < 0
                           else "no difference resolved") + ")")
    for lab, _ in labelled:
        d = data[lab]["diff_vs_heuristic"]
        verdicts.append(f"{lab} against {heuristic}: {_interval(d)} s ("
                        + ("worse" if d["low"] > 0 else "better" if d["high"] < 0
                           else "no difference resolved") + ")")
    for lab in distilled:  # the learned policy against its own distilled rule, seed-paired
        own = np.stack([res[k]["per_env"][LATENCY] for k in seed_names(res, lab)])
        rule = np.stack([res[k]["per_env"][LATENCY] for k in seed_names(res, lab + DISTILL_TAG)])
        d = seed_env_bootstrap(own - rule)
        data[lab]["diff_vs_distilled"] = {k: d[k] for k in ("mean", "low", "high")}
        data[lab + DISTILL_TAG]["trees"] = [t.describe() for t in trees[lab]]
        data[lab + DISTILL_TAG]["agreement"] = [t.agreement for t in trees[lab]]
        verdicts.append(f"{lab} against its distilled rule: {_interval(d)} s ("
                        + ("worse" if d["low"] > 0 else "better" if d["high"] < 0
                           else "no difference resolved") + ")")
    tree_text = "".join(
        f"\n- `{lab}` seed {pol.name.rsplit('-s', 1)[1]}: `{t.describe()}` ({t.chosen}; "
        f"reproduces {t.agreement:.0%} of {t.decisions} tuning decisions)"
        for lab in distilled for pol, t in zip(trained[lab][2], trees[lab]))
    same_streams = (": (w)'s streams" if key_salt is None and ctx.eval_seed == Context.eval_seed
                    else ": not (w)'s streams")
    body = "\n\n".join([
        made_by(ctx, experiment_key),
        f"Scenario `{scenario}` ({eval_envs} streams of {eval_steps} requests, first "
        f"{warmup} excluded; evaluation key `fold_in(PRNGKey({ctx.eval_seed}), {salt})`"
        f"{same_streams}). Each PPO variant changes "
        f"one thing and is trained with (w)'s steps and hyperparameters: seeds "
        f"{_seed_text(seeds)} of {steps} env steps each. Drop-"
        "inclusive mean latency (s) with the seed x stream 95% bootstrap CI; paired "
        "differences on the same streams. \"Short requests to fast GPUs in bursts\" is (w)'s "
        "\"why\": the share of short requests (true class) sent to a fastest GPU while a "
        f"burst lasts. The last two columns (quiet / burst phase) are the share of the "
        f"variant's decisions that `{GREEDY}` (the GPU where the shaping potential grows "
        f"least: the step-by-step greedy choice of the shaped reward) and `{heuristic}` "
        "would have sent to the same kind of GPU (speed tier) in the same state, on the "
        "variant's own trajectories, means over seeds. Why many seeds: (w)'s PPO on "
        "short_bursts scored 10.9 s (a win over sita_tuned, paired -1.11 [-1.63, -0.46] s, "
        "commit 3c6a1c5) when trained in its own program and 12.0 s (no difference) when "
        "trained in one program with (w)'s other scenarios: the same seeds and "
        "hyperparameters, different float rounding. A 3-seed interval did not cover that "
        "spread.",
        table(["policy", "what changes", "drop-incl. mean latency (s)", "drops",
               f"variant - {first} (s, paired, 95% CI)", f"- {heuristic} (s, paired)",
               "short requests to fast GPUs in bursts",
               f"same GPU type as {GREEDY} (quiet / burst)",
               f"same GPU type as {heuristic} (quiet / burst)"], rows),
        *(["The distilled rules (`evaluation.distill`: trees of depth <= 2 over the "
           "policy's observation features whose leaves are rules (" +
           ", ".join(f"`{r}`" for r in (heuristic, *also, GREEDY, *DISTILL_RULES)) +
           ") or a fixed GPU, each fitted to reproduce the most of the policy's decisions "
           "on the tuning streams (agreement by GPU speed tier), with and without fixed-GPU "
           "leaves, at depths 0-2; the one with the lowest latency on those tuning streams "
           "is kept; `a ? b : c` reads \"if a then b else c\"):"
           + tree_text] if distilled else []),
        "Reading (measured above): " + "; ".join(verdicts) + "."])
    return body, data


def _seed_text(seeds) -> str:
    s = list(seeds)
    if len(s) > 2 and s == list(range(s[0], s[-1] + 1)):
        return f"{s[0]}-{s[-1]} ({len(s)})"
    return ", ".join(map(str, s)) + f" ({len(s)})"


@experiment("x", "Ablations: what the learned router's win in short_bursts rests on")
def ablation(ctx: Context) -> Section:
    body, data = run_ablation(ctx, distill=True)
    return Section("(x) Ablations: what the learned router's win in short_bursts rests on",
                   body, data=data)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxserve.scripts.ablate`: chosen variants, seeds and evaluation key."""

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    known = {short_name(v[0]): v for v in ALL_VARIANTS}
    ap.add_argument("--variants", default=",".join(short_name(v[0]) for v in VARIANTS),
                    help="comma-separated short names of VARIANTS; the first is the paired "
                         f"baseline (known: {', '.join(known)})")
    ap.add_argument("--seeds", default=None,
                    help="training seeds, e.g. 8-23 or 0,1,2 (default: SEEDS of the budget)")
    ap.add_argument("--eval-seed", type=int, default=Context.eval_seed,
                    help="evaluation key seed (tuning streams are derived from it)")
    ap.add_argument("--budget", default="quick", choices=sorted(BUDGETS))
    ap.add_argument("--scenario", default=SCENARIO, choices=sorted(ROUTING_SCENARIOS),
                    help=f"Routing-v0 scenario (default {SCENARIO})")
    ap.add_argument("--heuristic", default=HEURISTIC,
                    help=f"the heuristic compared with and imitated (default {HEURISTIC}); a "
                         "registered routing policy")
    ap.add_argument("--also", default="",
                    help="comma-separated registered routing heuristics shown beside "
                         "--heuristic (fitted the same way), each paired against it")
    ap.add_argument("--distill", action="store_true",
                    help="also distil each seed's policy into a depth-2 tree of rules (fitted "
                         "on the tuning streams) and evaluate it beside the policy")
    ap.add_argument("--out", default=None, help="write the markdown section to this file")
    args = ap.parse_args(argv)
    labels = [x.strip() for x in args.variants.split(",") if x.strip()]
    bad = [x for x in labels if x not in known]
    if bad or not labels:
        print(f"error: unknown variant(s) {bad}; known: {list(known)}", file=sys.stderr)
        return 2
    try:
        seeds = _parse_seeds(args.seeds)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    heuristics = [n for n in policies.names("routing") if "oracle" not in n]
    also = tuple(x.strip() for x in args.also.split(",") if x.strip())
    unknown = [h for h in (args.heuristic, *also) if h not in heuristics]
    if unknown:
        print(f"error: unknown heuristic(s) {unknown}; known: {heuristics}", file=sys.stderr)
        return 2
    command = "python -m jaxserve.scripts.ablate " + " ".join(
        a if " " not in a else repr(a) for a in (argv if argv is not None else sys.argv[1:]))
    ctx = Context(budget=BUDGETS[args.budget], command=command, eval_seed=args.eval_seed)
    t0 = time.perf_counter()
    body, _ = run_ablation(ctx, [known[x] for x in labels], seeds, scenario=args.scenario,
                           heuristic=args.heuristic, also=also, distill=args.distill)
    text = f"{body}\n\n*Wall time: {time.perf_counter() - t0:.0f} s.*\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def short_name(label: str) -> str:
    """A variant's command-line name: "ppo, no shaping" -> "no-shaping", "ppo" -> "ppo"."""
    if label == "ppo":
        return "ppo"
    return label.split(", ", 1)[1].lower().replace(", ", "-").replace(" ", "-")


def _parse_seeds(spec: str | None):
    """`"8-23"` -> 8..23, `"0,1,2"` -> (0, 1, 2), None -> None; ValueError otherwise."""
    if spec is None:
        return None
    try:
        if "-" in spec:
            lo, hi = (int(x) for x in spec.split("-", 1))
            if hi < lo:
                raise ValueError
            return tuple(range(lo, hi + 1))
        return tuple(int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--seeds takes 'a-b' or 'a,b,c' with non-negative integers, got "
                         f"{spec!r}") from None


if __name__ == "__main__":
    sys.exit(main())
