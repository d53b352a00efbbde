"""Experiment (w): honest information, headroom, and whether a learned router beats the best
heuristic (issue 25, items 1, 2, 5).

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

from agents.experiments.common import (LATENCY, Context, Section, env_mean, fmt, learned_dict,
                                       made_by, seed_names, table, train_scenarios)
from agents.experiments.registry import experiment
from agents.experiments.routing import routing_heuristics
from jaxserve import policies
from jaxserve.core import arrivals as A
from jaxserve.core.sources import tuning_key
from jaxserve.envs.registry import ROUTING_SCENARIOS, make
from jaxserve.evaluation import evaluate_many
from jaxserve.core.stats import seed_env_bootstrap
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
HEURISTICS = ("sita_tuned", "sita", "sita_predicted", "sita_prompt", "sed", "least_work_left", "jsq",
              "power_of_two", "round_robin")
ORACLES = {"sita, true lengths": "sita", "sed, true lengths": "sed_oracle",
           "least_work_left, true lengths": "least_work_left_oracle"}


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


def routing_record(env, params, policy, key, num_envs: int, num_steps: int) -> dict:
    """Per-request record of one policy: `(num_envs, num_steps)` arrays of the GPU chosen,
    the request's true size class (a report, never seen by the policy), its arrival phase
    and the cluster's requests in system before the decision."""
    edges = params.size_edges

    def one(k):
        k0, k = jax.random.split(k)
        obs, state = env.reset_env(k0, params)

        def body(carry, k):
            obs, state = carry
            ka, ks = jax.random.split(k)
            a = jnp.clip(jnp.asarray(policy(ka, obs, state, params), jnp.int32), 0,
                         env.num_gpus - 1)
            rec = {"action": a, "cls": A.size_class(state.pending.output, edges),
                   "phase": state.phase,
                   "in_system": (state.cluster.queues.count.sum()
                                 + state.cluster.servers.run_count.sum())}
            obs, state, *_ = env.step_env(ks, state, a, params)
            return (obs, state), rec

        _, recs = jax.lax.scan(body, (obs, state), jax.random.split(k, num_steps))
        return recs

    out = jax.jit(jax.vmap(one))(jax.random.split(key, num_envs))
    return {k: np.asarray(v) for k, v in out.items()}


def _phase_fractions(rec: dict, fast: np.ndarray, warmup: int) -> np.ndarray:
    """`(phases, classes)` share of each (phase, true class) sent to a fast GPU."""
    a, c, ph = (rec[k][:, warmup:].ravel() for k in ("action", "cls", "phase"))
    to_fast = fast[a]
    out = np.full((int(ph.max()) + 1 if ph.size else 1, int(c.max()) + 1), np.nan)
    for p in range(out.shape[0]):
        for k in range(out.shape[1]):
            m = (ph == p) & (c == k)
            if m.any():
                out[p, k] = to_fast[m].mean()
    return out


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


def train_families(scen: dict, seeds, steps, ctx) -> dict:
    """`{scenario: [policy per seed]}`: `train_scenarios` once per group of scenarios whose
    parameters have equal shapes (a class mix per arrival phase has one more axis)."""
    groups: dict = {}
    for n, (env, params) in scen.items():
        groups.setdefault(_shape_signature(params), []).append(n)
    out = {}
    for names in groups.values():
        trained, _ = train_scenarios("Routing-v0", scen[names[0]][0],
                                     [scen[n][1] for n in names], ALGO, seeds, steps, ctx)
        out.update(zip(names, trained))
    return out


@experiment("w", "Honest information, headroom, and learned vs best heuristic")
def routing_win(ctx: Context) -> Section:
    b = ctx.budget
    seeds, steps = WIN_BUDGETS[b.name]
    eval_envs, eval_steps, warmup = WIN_EVAL[b.name]
    scen = {n: make("Routing-v0", scenario=n) for n in ROUTING_SCENARIOS}
    names = list(scen)
    trained = train_families(scen, seeds, steps, ctx)
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
        heur = {n: p for n, p in routing_heuristics(env, params, key, tune).items()
                if n in HEURISTICS}
        learned = learned_dict({ALGO: trained[name]})
        ctx.log(f"  evaluating (w) {name}")
        res = evaluate_many(env, params, {**heur, **learned}, key, eval_envs, eval_steps,
                            warmup=warmup)
        exact = params.replace(estimate_mode=jnp.int32(A.ESTIMATE_EXACT))
        oracle = {"sita, true lengths": policies.get("sita", env=env, params=exact,
                                                     key=tuning_key(key)),
                  "sed, true lengths": policies.get("sed_oracle"),
                  "least_work_left, true lengths": policies.get("least_work_left_oracle")}
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
        d_best = _boot_diff(res, ALGO, res[best]["per_env"][LATENCY])
        ref = min(oracle, key=lambda n: env_mean(res[n]["per_env"][LATENCY]))
        lat = {n: _boot_mean(res, n)["mean"] for n in [ALGO, *order, *oracle]}
        verdict = ("wins" if d_best["high"] < 0 else "loses" if d_best["low"] > 0
                   else "ties (CI includes 0)")
        summary.append([name, f"{lat[ALGO]:.3g}", f"{best} {lat[best]:.3g}",
                        _interval(d_best), verdict, f"{ref} {lat[ref]:.3g}"])
        parts += [f"### {name}", ROUTING_SCENARIOS[name]["reason"],
                  made_by(ctx, "w"),
                  table(["policy", "drop-incl. mean latency (s)", "95% CI (s)", "drops",
                         f"{ALGO} - policy (s, paired, 95% CI)"], rows)]
        data[name] = {"latency": lat, "best_heuristic": best,
                      "diff_vs_best": {k: d_best[k] for k in ("mean", "low", "high")}}
        ctx.log(f"  recording (w) {name}")
        speed = np.asarray(gpu_speeds(params))
        fast = speed >= speed.max() * (1 - 1e-6)
        why = []
        for n in [ALGO + "-s" + str(seeds[0]), best]:
            rec = routing_record(env, params, learned.get(n, heur.get(n)),
                                 ctx.eval_key(90 + i), eval_envs, eval_steps)
            frac = _phase_fractions(rec, fast, warmup)
            for p in range(frac.shape[0]):
                why.append([n, f"phase {p}"] + [f"{100 * x:.0f}%" if np.isfinite(x) else
                                                 "none arrived" for x in frac[p]])
            data[name].setdefault("to_fast", {})[n] = frac.tolist()
        parts += ["Where requests go (share of each true size class sent to a fastest GPU, by "
                  "arrival phase, phase 1 = bursts; fresh streams; the class is a report, not "
                  "something a policy saw):",
                  table(["policy", "arrival phase"]
                        + [f"class {k}" for k in range(len(why[0]) - 2)], why),
                  _reading(name, lat, best, ref, d_best, data[name]["to_fast"])]
    body = "\n\n".join([
        parts[0], "Summary (best learned vs best heuristic vs the best clairvoyant reference, "
        "drop-inclusive mean latency, s):",
        table(["scenario", ALGO, "best heuristic", f"{ALGO} - best heuristic (95% CI)",
               "verdict", "best clairvoyant"], summary), *parts[1:]])
    def draw(path):
        _plot_to_fast(data, path)
    body += ("\n\nThe figure shows the shares of the tables above: per scenario, where the "
             "learned router (seed 0) and the best heuristic send each true size class in "
             "quiet phases and in bursts.")
    return Section("(w) Honest information, headroom, and learned vs best heuristic", body,
                   figures={"results_where_requests_go.png": draw}, data=data)


def _plot_to_fast(data: dict, path) -> None:
    """Per scenario, the share of short and long requests sent to a fastest GPU in each arrival
    phase: the learned router (its first seed) beside the best heuristic (grouped bars)."""
    from jaxserve.evaluation.plots import axes_row

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
