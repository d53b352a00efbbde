"""Experiment (w): honest information, headroom, and whether a learned router beats the best
heuristic (docs/results.md, section (w)).

Every router (learned or heuristic) reads the same noisy output-length prediction
(Routing-v0's default `estimate_mode=1`, `estimate_noise=1.0`). The table of each scenario
has three blocks:
  - the learned router (PPO, several seeds, trained on the scenario);
  - every registered heuristic, SITA fitted on tuning streams (`tuning_key`), never on the
    evaluation streams;
  - clairvoyant references (not realisable): the heuristics given the *true* output lengths
    (SITA refitted and run with exact lengths, SED and least-work-left reading the true
    remaining work), on the same arrivals and tokens (the estimate is drawn from its own
    uniform, so changing `estimate_mode` leaves the request stream unchanged).
Statistics: `stats.seed_env_bootstrap`, the crossed seed x stream bootstrap, for every mean
and every paired difference (a heuristic is a single row: the bootstrap over streams); every
policy's drops are shown. "Why": per-request records of where each policy sends short and
long requests (true class) in each phase of the arrival process.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.agents.experiments.common import (LATENCY, Context, Section, env_mean, fmt, learned_dict,
                                       made_by, seed_names, table, train_scenarios)
from jaxserve.agents.experiments.registry import experiment
from jaxserve.agents.experiments.routing import routing_heuristics
from jaxserve import policies
from jaxserve.core import arrivals as A
from jaxserve.core.sources import tuning_key
from jaxserve.core.stats import seed_env_bootstrap
from jaxserve.envs.registry import make
from jaxserve.envs.routing import ROUTING_SCENARIOS
from jaxserve.evaluation import evaluate_many
from jaxserve.evaluation.distill import distil
from jaxserve.evaluation.plots import axes_row
from jaxserve.policies.routing import gpu_speeds

ALGO = "ppo"
# Training budget of (w) per budget name: (seeds, env steps per seed). The quick budget is
# what 2 CPU cores train in a few minutes; "full" is meant for a GPU.
WIN_BUDGETS = {"quick": ((0, 1, 2), 393_216), "full": ((0, 1, 2, 3, 4), 2_097_152),
               "tiny": ((0,), 2048)}
# Evaluation of (w) per budget name: (streams, requests per stream, warm-up requests left out).
# Larger than the shared budget's: evaluation is cheap next to training, and the CIs of a
# paired difference between close policies need it.
WIN_EVAL = {"quick": (16, 1024, 64), "full": (32, 2048, 128), "tiny": (2, 64, 8)}
# Tuning streams of `sita_tuned` per budget name: (streams, requests per stream, warm-up).
WIN_TUNE = {"quick": (8, 1024, 64), "full": (16, 2048, 128), "tiny": (2, 64, 8)}
# Points of the budget curve per budget name: the training run is cut into this many equal
# chunks and the policy after each is evaluated on the table's streams (the last point is the
# table's policy).
WIN_CHECKPOINTS = {"quick": 4, "full": 8, "tiny": 2}
HEURISTICS = ("sita_tuned", "sita_burst_tuned", "sita", "sita_predicted", "sita_prompt", "sed",
              "least_work_left", "jsq", "power_of_two", "round_robin")
# A learned policy's distilled rule (`evaluation.distill`) is named "<label>" + DISTILL_TAG.
DISTILL_TAG = ": distilled rule (tree of depth <= 2)"
ORACLES = {"sita, true lengths": "sita", "sed, true lengths": "sed_oracle",
           "least_work_left, true lengths": "least_work_left_oracle"}


def speed_tiers(params) -> np.ndarray:
    """`(num_gpus,)` int32 speed tier per GPU (equal relative speed, one tier)."""
    speed = np.asarray(gpu_speeds(params))
    return np.unique(np.round(speed / speed.max(), 6), return_inverse=True)[1].astype(np.int32)


def distil_seeds(env, params, pols, rules: dict, key, tune, label: str) -> tuple[list, list]:
    """Each seed's learned policy in `pols` distilled (`evaluation.distill.distil`) on the
    tuning streams of `key` (`tune` = (streams, requests, warm-up)), agreement by GPU speed
    tier, leaves from `rules`. Returns `([policy named "<label><DISTILL_TAG>-s<seed>"],
    [RuleTree])`, in `pols`' order."""
    t_envs, t_steps, t_warm = tune
    out, trees = [], []
    for pol in pols:
        seed = pol.name.rsplit("-s", 1)[1]
        d, tree = distil(env, params, pol, rules, tuning_key(key), num_envs=t_envs,
                         num_steps=t_steps, warmup=t_warm, groups=speed_tiers(params),
                         feature_names=env.feature_names,
                         name=f"{label}{DISTILL_TAG}-s{seed}")
        out.append(d)
        trees.append(tree)
    return out, trees


def clairvoyant(env, params, key) -> tuple:
    """`(params with exact output lengths, {name: policy})`: the clairvoyant references of
    `ORACLES` for evaluation key `key` (SITA refitted on its tuning streams with the true
    lengths). Not realisable: bounds on what knowing the lengths is worth."""
    exact = params.replace(estimate_mode=jnp.int32(A.ESTIMATE_EXACT))
    pols = {"sita, true lengths": policies.get("sita", env=env, params=exact,
                                               key=tuning_key(key)),
            "sed, true lengths": policies.get("sed_oracle"),
            "least_work_left, true lengths": policies.get("least_work_left_oracle")}
    assert set(pols) == set(ORACLES)
    return exact, pols


def _boot_mean(res: dict, name: str) -> dict:
    """Bootstrap mean of the drop-inclusive latency: seed x stream for an algorithm."""
    keys = seed_names(res, name) or [name]
    return seed_env_bootstrap(np.stack([res[k]["per_env"][LATENCY] for k in keys]))


def _boot_diff(res: dict, algo: str, other: dict) -> dict:
    """Paired `algo - other` (per-stream values `other`), seed x stream bootstrap."""
    d = np.stack([res[k]["per_env"][LATENCY] - other for k in seed_names(res, algo)])
    return seed_env_bootstrap(d)


def _drops(res: dict, name: str) -> str:
    keys = seed_names(res, name)
    if not keys:
        return str(int(res[name]["dropped"]))
    return " / ".join(str(int(res[k]["dropped"])) for k in keys) + " (per seed)"


def _interval(b: dict) -> str:
    return f"{b['mean']:+.3g} [{b['low']:+.3g}, {b['high']:+.3g}]"


def _to_fast_shares(res: dict, names, fast: np.ndarray) -> np.ndarray:
    """`(phases, classes)` share of the measured requests of each (arrival phase, true size
    class) sent to a fastest GPU, pooled over the result entries `names` (a learned policy's
    seeds), from `evaluate_many`'s `class_mix_by_phase`; NaN where none arrived."""
    mix = sum(np.asarray(res[n]["class_mix_by_phase"], np.float64) for n in names)
    total = mix.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, mix[:, fast, :].sum(axis=1) / total, np.nan)


def _reading(name: str, lat: dict, best: str, ref: str, d_best: dict, to_fast: dict) -> str:
    """The section's reading of scenario `name`, from its measured numbers only."""
    verdict = ("PPO beats it" if d_best["high"] < 0 else "PPO loses to it"
               if d_best["low"] > 0 else "no difference is resolved (the CI includes 0)")
    learned = next(k for k in to_fast if k.startswith(ALGO))
    lf, hf = np.asarray(to_fast[learned]), np.asarray(to_fast[best])
    def pct(x):
        return f"{100 * x:.0f}%" if np.isfinite(x) else "none arrived"
    shares = "; ".join(
        f"phase {p}: short {pct(lf[p, 0])} vs {pct(hf[p, 0])}, long "
        f"{pct(lf[p, -1])} vs {pct(hf[p, -1])}" for p in range(min(len(lf), len(hf))))
    return (f"Reading ({name}, measured above): PPO {lat[ALGO]:.3g} s against the best "
            f"heuristic, {best}, {lat[best]:.3g} s: paired difference {_interval(d_best)} s, "
            f"so {verdict}. Headroom: the best clairvoyant reference ({ref}, "
            f"{lat[ref]:.3g} s) is {lat[best] - lat[ref]:.3g} s below the best heuristic, what "
            f"knowing the true lengths would be worth. Share of requests sent to a fastest "
            f"GPU, {learned} vs {best}: {shares}.")


def _shape_signature(params) -> tuple:
    """Tree structure and leaf shapes: scenarios with equal signatures train in one program."""
    leaves, tree = jax.tree.flatten(params)
    return (str(tree), tuple(np.shape(x) for x in leaves))


def _per_phase_mix(params, phases: int):
    """`params` with its token class mix written once per arrival phase (`(phases, C)`, equal
    rows) if it has one mix: the same law and, from the same uniforms, the same requests
    (`arrivals.tokens_from_uniforms` picks the phase's row, then the same cdf), in the shape
    of a scenario whose mix depends on the phase, so the two train in one program."""
    w = params.tokens.weights
    if w.ndim != 1:
        return params
    return params.replace(tokens=params.tokens.replace(
        weights=jnp.broadcast_to(w, (phases,) + w.shape)))


def train_families(scen: dict, seeds, steps, ctx, checkpoints: int = 1) -> tuple[dict, dict]:
    """`({scenario: [policy per seed]}, {scenario: [[policy per checkpoint] per seed]},
    checkpoint env steps)`: `train_scenarios` once per group of scenarios whose parameters
    have equal shapes, after writing one-mix scenarios in per-phase form where another
    scenario has a class mix per arrival phase (`_per_phase_mix`)."""
    plist = {n: p for n, (_, p) in scen.items()}
    phased = [p.tokens.weights.shape[0] for p in plist.values() if p.tokens.weights.ndim == 2]
    if phased:
        plist = {n: (_per_phase_mix(p, phased[0]) if p.arrivals.num_phases == phased[0]
                     else p) for n, p in plist.items()}
    groups: dict = {}
    for n, p in plist.items():
        groups.setdefault(_shape_signature(p), []).append(n)
    out, snaps, at = {}, {}, None
    for names in groups.values():
        trained, curves = train_scenarios("Routing-v0", scen[names[0]][0],
                                          [plist[n] for n in names], ALGO, seeds, steps, ctx,
                                          checkpoints=checkpoints)
        out.update(zip(names, trained))
        snaps.update(zip(names, curves.get("checkpoint_policies", [[[p] for p in t]
                                                                   for t in trained])))
        at = curves.get("checkpoint_steps", np.asarray([steps]))
    return out, snaps, at


@experiment("w", "Honest information, headroom, and learned vs best heuristic")
def routing_win(ctx: Context) -> Section:
    b = ctx.budget
    seeds, steps = WIN_BUDGETS[b.name]
    eval_envs, eval_steps, warmup = WIN_EVAL[b.name]
    scen = {n: make("Routing-v0", scenario=n) for n in ROUTING_SCENARIOS}
    names = list(scen)
    trained, snapshots, ckpt_steps = train_families(scen, seeds, steps, ctx,
                                                    WIN_CHECKPOINTS[b.name])
    parts = [
        "Every router reads the same noisy output-length prediction (Routing-v0's default, "
        "`estimate_mode=1`, `estimate_noise=1.0`: the prediction is the true length times "
        "exp(z), z ~ N(0, 1)); none sees the true length or size class. Heuristics: every "
        "registered routing policy, SITA fitted on tuning streams (`tuning_key` of the "
        "evaluation key). Clairvoyant references (not realisable) read the true lengths on "
        "the same request streams. Means and paired differences: the crossed seed x stream "
        f"bootstrap (`stats.seed_env_bootstrap`, 95%): {len(seeds)} training seed(s) of "
        f"{steps} env steps each, {eval_envs} evaluation streams of {eval_steps} "
        f"requests (first {warmup} excluded), so the intervals count training and "
        "evaluation noise. Drops: every policy's, measured requests refused by a full queue "
        f"(each counted at {float(np.asarray(scen[names[0]][1].drop_penalty_s)):g} s).",
    ]
    summary, data = [], {}
    for i, name in enumerate(names):
        env, params = scen[name]
        key = ctx.eval_key(70 + i)
        t_envs, t_steps, t_warm = WIN_TUNE[b.name]
        tune = dataclasses.replace(b, tune_envs=t_envs, tune_steps=t_steps, warmup=t_warm)
        heur = routing_heuristics(env, params, key, tune, names=HEURISTICS)
        learned = learned_dict({ALGO: trained[name]})
        # Each seed's own distilled rule, its leaves the table's rules (and the greedy policy
        # of the shaping potential): a win must also be one over what the policy does.
        rules = {**heur, "least_marginal": policies.get("least_marginal", kind="routing")}
        dist, trees = distil_seeds(env, params, trained[name], rules, key,
                                   (t_envs, t_steps, t_warm), ALGO)
        learned.update({d.__name__: d for d in dist})
        # Earlier checkpoints of each seed, named "ppo@c/K-s<seed>" (not "ppo-s...": they are
        # not the table's policy); the last checkpoint is the table's policy itself.
        earlier = {f"{ALGO}@{c + 1}/{len(ckpt_steps)}-s{seed}": snapshots[name][j][c]
                   for j, seed in enumerate(seeds) for c in range(len(ckpt_steps) - 1)}
        ctx.log(f"  evaluating (w) {name}")
        res = evaluate_many(env, params, {**heur, **learned, **earlier}, key, eval_envs,
                            eval_steps, warmup=warmup)
        exact, oracle = clairvoyant(env, params, key)
        res.update(evaluate_many(env, exact, oracle, key, eval_envs, eval_steps,
                                 warmup=warmup))
        order = sorted(heur, key=lambda n: env_mean(res[n]["per_env"][LATENCY]))
        best = order[0]
        rows = []
        for n in [ALGO, *order, *oracle]:
            m = _boot_mean(res, n)
            label = (f"**{n}** ({len(seeds)} seeds)" if n == ALGO
                     else f"*{n}* (clairvoyant)" if n in oracle else n)
            diff = "" if n == ALGO else _interval(_boot_diff(res, ALGO,
                                                             res[n]["per_env"][LATENCY]))
            rows.append([label, fmt(m["mean"]), f"[{m['low']:.3g}, {m['high']:.3g}]",
                         _drops(res, n), diff])
        dist_names = seed_names(res, ALGO + DISTILL_TAG)
        dist_lat = np.stack([res[k]["per_env"][LATENCY] for k in dist_names])
        m = seed_env_bootstrap(dist_lat)
        d_dist = seed_env_bootstrap(np.stack([res[k]["per_env"][LATENCY]
                                              for k in seed_names(res, ALGO)]) - dist_lat)
        rows.insert(1, [f"{ALGO}'s distilled rule ({len(dist_names)} seeds)", fmt(m["mean"]),
                        f"[{m['low']:.3g}, {m['high']:.3g}]",
                        " / ".join(str(int(res[k]["dropped"])) for k in dist_names),
                        _interval(d_dist)])
        d_best = _boot_diff(res, ALGO, res[best]["per_env"][LATENCY])
        ref = min(oracle, key=lambda n: env_mean(res[n]["per_env"][LATENCY]))
        lat = {n: _boot_mean(res, n)["mean"] for n in [ALGO, *order, *oracle]}
        # "better" only where PPO beats the best fitted rule and its own distilled rule.
        verdict = ("worse" if d_best["low"] > 0
                   else "ties (CI includes 0)" if d_best["high"] >= 0
                   else "better" if d_dist["high"] < 0
                   else "better than every fitted rule, not than its distilled rule")
        summary.append([name, f"{lat[ALGO]:.3g}", f"{best} {lat[best]:.3g}",
                        _interval(d_best), _interval(d_dist), verdict,
                        f"{ref} {lat[ref]:.3g}"])
        parts += [f"### {name}", ROUTING_SCENARIOS[name]["reason"],
                  made_by(ctx, "w"),
                  table(["policy", "drop-incl. mean latency (s)", "95% CI (s)", "drops",
                         f"{ALGO} - policy (s, paired, 95% CI)"], rows),
                  f"{ALGO}'s distilled rule (`evaluation.distill`): per seed, trees of depth "
                  "<= 2 over the policy's observation features whose leaves are the rules "
                  "above (and `least_marginal`) or a fixed GPU, each fitted to reproduce the "
                  "most of its decisions (by GPU speed tier) on the tuning streams, with and "
                  "without fixed-GPU leaves, at depths 0-2; the one with the lowest latency on "
                  "those tuning streams is kept; `a ? b : c` reads \"if a then b else c\":"
                  + "".join(f"\n- seed {p.name.rsplit('-s', 1)[1]}: `{t.describe()}` "
                            f"({t.chosen}; reproduces {t.agreement:.0%} of {t.decisions} "
                            "decisions)" for p, t in zip(trained[name], trees))]
        data[name] = {"latency": lat, "best_heuristic": best,
                      "diff_vs_best": {k: d_best[k] for k in ("mean", "low", "high")},
                      "diff_vs_distilled": {k: d_dist[k] for k in ("mean", "low", "high")},
                      "distilled": {"mean": m["mean"], "low": m["low"], "high": m["high"],
                                    "trees": [t.describe() for t in trees],
                                    "agreement": [t.agreement for t in trees]}}
        speed = np.asarray(gpu_speeds(params))
        fast = speed >= speed.max() * (1 - 1e-6)
        why = []
        for n, entries in ((ALGO, seed_names(res, ALGO)), (best, [best])):
            frac = _to_fast_shares(res, entries, fast)
            for p in range(frac.shape[0]):
                why.append([n, f"phase {p}"] + [f"{100 * x:.0f}%" if np.isfinite(x) else
                                                 "none arrived" for x in frac[p]])
            data[name].setdefault("to_fast", {})[n] = frac.tolist()
        curve = []
        for c, at in enumerate(ckpt_steps):
            names_c = (seed_names(res, ALGO) if c == len(ckpt_steps) - 1 else
                       [f"{ALGO}@{c + 1}/{len(ckpt_steps)}-s{seed}" for seed in seeds])
            m = seed_env_bootstrap(np.stack([res[k]["per_env"][LATENCY] for k in names_c]))
            d = seed_env_bootstrap(np.stack([res[k]["per_env"][LATENCY]
                                             - res[best]["per_env"][LATENCY]
                                             for k in names_c]))
            curve.append({"env_steps": int(at), "mean": m["mean"], "low": m["low"],
                          "high": m["high"], "diff_vs_best": {k: d[k] for k in
                                                              ("mean", "low", "high")},
                          "drops": [int(res[k]["dropped"]) for k in names_c]})
        data[name]["budget_curve"] = curve
        data[name]["best_heuristic_ci"] = {k: _boot_mean(res, best)[k]
                                           for k in ("mean", "low", "high")}
        data[name]["clairvoyant"] = {"name": ref, "mean": lat[ref]}
        parts += [f"Budget curve (the {ALGO} runs above, evaluated after each of "
                  f"{len(ckpt_steps)} equal parts of their training, on the same streams):",
                  table(["env steps per seed", f"{ALGO} drop-incl. mean latency (s, 95% CI)",
                         "drops (per seed)", f"{ALGO} - {best} (s, paired, 95% CI)"],
                        [[f"{pt['env_steps']:,}",
                          f"{pt['mean']:.3g} [{pt['low']:.3g}, {pt['high']:.3g}]",
                          " / ".join(map(str, pt["drops"])), _interval(pt["diff_vs_best"])]
                         for pt in curve]),
                  "Where requests go (share of each true size class sent to a fastest GPU, by "
                  f"arrival phase, phase 1 = bursts; the evaluation streams above, {ALGO}'s "
                  "seeds pooled; the class is a report, not something a policy saw):",
                  table(["policy", "arrival phase"]
                        + [f"class {k}" for k in range(len(why[0]) - 2)], why),
                  _reading(name, lat, best, ref, d_best, data[name]["to_fast"])]
    body = "\n\n".join([
        parts[0], "Summary (best learned vs best heuristic vs the best clairvoyant reference, "
        "drop-inclusive mean latency, s):",
        table(["scenario", ALGO, "best heuristic", f"{ALGO} - best heuristic (95% CI)",
               f"{ALGO} - its distilled rule (95% CI)", "verdict", "best clairvoyant"],
              summary), *parts[1:]])
    body += ("\n\nThe first figure shows the shares of the tables above: per scenario, where "
             f"the learned router ({ALGO}, seeds pooled) and the best heuristic send each true "
             "size class in quiet phases and in bursts. The second is each scenario's budget "
             f"curve: {ALGO}'s drop-inclusive mean latency (seed x stream 95% CI) against "
             "training steps, beside the best heuristic and the best clairvoyant reference.")
    return Section("(w) Honest information, headroom, and learned vs best heuristic", body,
                   figures={"results_where_requests_go.png": lambda p: _plot_to_fast(data, p),
                            "results_budget_curves.png": lambda p: _plot_budget(data, p)},
                   data=data)


def _plot_to_fast(data: dict, path) -> None:
    """Per scenario, the share of short and long requests sent to a fastest GPU in each arrival
    phase: the learned router (its first seed) beside the best heuristic (grouped bars)."""

    names = list(data)
    with axes_row(path, ncols=len(names), figsize=(4.2 * len(names), 3.6)) as (_, axes):
        for ax, name in zip(axes, names):
            shares = data[name]["to_fast"]
            pols = list(shares)
            frac = [np.asarray(shares[p], float) for p in pols]
            labels = [f"{'quiet' if ph == 0 else 'burst'}\n{'short' if c == 0 else 'long'}"
                      for ph in range(frac[0].shape[0]) for c in range(frac[0].shape[1])]
            x = np.arange(len(labels))
            width = 0.8 / len(pols)
            for i, (p, f) in enumerate(zip(pols, frac)):
                ax.bar(x + (i - (len(pols) - 1) / 2) * width, 100 * np.nan_to_num(f.ravel()),
                       width, label=p)
            for j in np.flatnonzero(np.isnan(frac[0].ravel())):
                ax.text(x[j], 2, "none\narrived", ha="center", fontsize=7)
            ax.set_xticks(x, labels, fontsize=8)
            ax.set_ylim(0, 105)
            ax.set_title(name, fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8)  # the best heuristic differs between scenarios
        axes[0].set_ylabel("% sent to a fastest GPU")


def _plot_budget(data: dict, path) -> None:
    """Per scenario, the learned router's drop-inclusive mean latency (95% CI band) against
    training env steps per seed, with the best heuristic (its CI band) and the best
    clairvoyant reference as horizontal lines."""

    names = list(data)
    with axes_row(path, ncols=len(names), figsize=(4.2 * len(names), 3.6)) as (_, axes):
        for ax, name in zip(axes, names):
            d = data[name]
            x = np.asarray([pt["env_steps"] for pt in d["budget_curve"]], float)
            y = np.asarray([[pt["mean"], pt["low"], pt["high"]] for pt in d["budget_curve"]])
            ax.plot(x, y[:, 0], "o-", label=ALGO)
            ax.fill_between(x, y[:, 1], y[:, 2], alpha=0.25)
            h = d["best_heuristic_ci"]
            ax.axhline(h["mean"], color="C1", ls="--", label=d["best_heuristic"])
            ax.axhspan(h["low"], h["high"], color="C1", alpha=0.15)
            c = d["clairvoyant"]
            ax.axhline(c["mean"], color="C2", ls=":", label=f"{c['name']} (clairvoyant)")
            ax.set_xlabel("training env steps per seed")
            ax.set_title(name, fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[0].set_ylabel("drop-incl. mean latency (s)")
