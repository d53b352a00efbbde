"""Plots of the real traces beside their fitted synthetic workloads, and fit-quality tables.

Run from the repository root. The trace files are read from `--traces-dir` (a folder laid out
like the trace mirror) if given, else with `jaxserve.traces.path` (`$JAXSERVE_TRACES_DIR`, e.g.
`../shared/traces` beside the repository, then the user cache: `jaxserve-traces fetch --all`
downloads them):

    python -m jaxserve.scripts.plot_traces                 # figures into docs/figures, tables to stdout
    python -m jaxserve.scripts.plot_traces --no-replay     # skip the (JAX-compiling) busy-fraction table

For each Azure trace (LLM 2023 code and conv, Functions 2021 subsample) it fits a workload
(`jaxserve.traces.fit_workload`: 2-phase MMPP by moment matching, lognormal tokens) and draws
one synthetic trace of the same length from it; the figure shows the arrival rate over time of
both (10 s and 60 s bins) and their token histograms. For BurstGPT, whose full trace is not
available, it compares `burstgpt_like` with the published aggregates (hour-of-day profile,
daily counts, first-week per-minute token throughput) and the 29 real rows' tokens.

Printed: the fit-quality tables (`fit_table`: trace / mean of 5 synthetic traces of 4x the
trace's length, relative error; arrivals, then tokens for lognormal and empirical fits),
the BurstGPT aggregates table, offered loads, and (unless `--no-replay`) busy fractions
measured by replaying rescaled windows under JSQ.
Everything is seeded; the numbers in docs/traces.md are this script's output.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import jaxserve
from jaxserve.core.profiles import get_profile
from jaxserve.envs.routing import routing_gpus
from jaxserve.evaluation.replay import replay_windows
from jaxserve.traces import (burstgpt_like, burstgpt_profile, burstgpt_stats,  # noqa: E402
                             fit_report, fit_table, fit_tokens, fit_workload, load,
                             offered_load, published_stats, rescale_to_load, resolve,
                             sample_workload, windows)

AZURE = [  # (name, title, `jaxserve.traces.registry` name, load kwargs)
    ("azure_code", "Azure LLM 2023 code", "azure_llm_2023_code", {}),
    ("azure_conv", "Azure LLM 2023 conv", "azure_llm_2023_conv", {}),
    ("azure_functions", "Azure Functions 2021 subsample (50 tok/s, prompt 512)",
     "azure_functions_2021_sample", {}),
]
DPI = 80
ARRIVAL_KEYS = ("mean_rate", "cv_interarrival", "iod_1s", "iod_60s")
TOKEN_KEYS = ("prompt_mean", "prompt_p50", "prompt_p90", "prompt_p99",
              "output_mean", "output_p50", "output_p90", "output_p99")


def _rate(ax, t, span, label, color):
    t = np.asarray(t) - t[0]
    for w, lw, alpha in ((10.0, 0.6, 0.5), (60.0, 1.6, 1.0)):
        k = max(1, int(np.floor(span / w)))
        c = np.bincount(np.floor(t / w).astype(int), minlength=k)[:k] / w
        ax.step(np.arange(k) * w / 60.0, c, where="post", lw=lw, alpha=alpha, color=color,
                label=f"{label}, {w:g} s bins")
    ax.set_xlabel("time (min)")
    ax.set_ylabel("arrival rate (req/s)")
    ax.legend(fontsize=7, loc="upper right")


def _hist(ax, real, synth, what):
    real, synth = np.asarray(real, float), np.asarray(synth, float)
    if real.min() == real.max() and synth.min() == synth.max():
        ax.text(0.5, 0.5, f"{what} tokens: constant {real[0]:g} (trace) / {synth[0]:g} (fitted)",
                ha="center", va="center", transform=ax.transAxes, fontsize=9)
        ax.set_axis_off()
        return
    lo = max(1.0, min(real.min(), synth.min()))
    hi = max(real.max(), synth.max(), lo * 2)
    bins = np.geomspace(lo, hi * 1.001, 40)
    ax.hist(real, bins=bins, weights=np.full(real.shape, 1.0 / real.size), alpha=0.55,
            label="trace", color="C0")
    ax.hist(synth, bins=bins, weights=np.full(synth.shape, 1.0 / synth.size), histtype="step",
            lw=1.5, label="fitted", color="C3")
    ax.set_xscale("log")
    ax.set_xlabel(f"{what} tokens (log bins)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=7)


def plot_fitted(name, title, tr, fit, out: Path, seed: int):
    syn = sample_workload(seed, fit.arrivals, fit.tokens, len(tr))
    span = float(tr.arrival_s[-1] - tr.arrival_s[0])
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.2))
    _rate(axes[0, 0], tr.arrival_s, span, "trace", "C0")
    axes[0, 0].set_title(f"{title}: trace", fontsize=9)
    _rate(axes[0, 1], syn.arrival_s, span, "synthetic", "C3")
    p = fit.mmpp.params
    axes[0, 1].set_title(f"fitted 2-phase MMPP, one draw of the same length\n(rates "
                         f"{p['l1']:.3g} / {p['l2']:.3g} req/s, switching {p['r12']:.2g} / "
                         f"{p['r21']:.2g} /s)", fontsize=8)
    ymax = max(axes[0, 0].get_ylim()[1], axes[0, 1].get_ylim()[1])
    for ax in axes[0]:
        ax.set_ylim(0, ymax)
        ax.set_xlim(0, span / 60.0)
    _hist(axes[1, 0], tr.prompt_tokens, syn.prompt_tokens, "prompt")
    _hist(axes[1, 1], tr.output_tokens, syn.output_tokens, "output")
    axes[1, 0].set_title("prompt tokens (fitted: lognormal)", fontsize=9)
    axes[1, 1].set_title("output tokens (fitted: lognormal)", fontsize=9)
    fig.tight_layout()
    path = out / f"traces_{name}.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_burstgpt(prof, out: Path, seed: int):
    pub = published_stats(prof)
    trend = burstgpt_like(seed, days=61, profile=prof)
    observed = burstgpt_like(seed + 1, days=61, day_profile="observed", profile=prof)
    week = burstgpt_like(seed + 2, days=7, day_profile="observed", profile=prof)
    st_t, st_o, st_w = burstgpt_stats(trend), burstgpt_stats(observed), burstgpt_stats(week)
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.2))
    ax = axes[0, 0]
    ax.plot(np.arange(24), pub["hourly"] / pub["hourly"].mean(), "o-", label="published (61 days)")
    ax.plot(np.arange(24), st_t["hourly"] / st_t["hourly"].mean(), "s--", ms=3, color="C3",
            label="synthetic, 61 days")
    ax.set_xlabel("hour of day")
    ax.set_ylabel("requests / mean hour")
    ax.set_title("hour-of-day profile", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    d = np.arange(prof.daily.shape[0])
    ax.semilogy(d, prof.daily, "o-", ms=3, label="published daily requests")
    ax.semilogy(d, st_o["daily"][:d.shape[0]], "--", color="C2", label='synthetic, "observed"')
    ax.semilogy(d, st_t["daily"][:d.shape[0]], "-", color="C3", label='synthetic, "trend"')
    ax.set_xlabel("day")
    ax.set_ylabel("requests per day")
    ax.set_title(f"daily volume (trend {100 * prof.trend_slope:+.1f} %/day)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1, 0]
    m = np.arange(7 * 1440) / 1440.0
    ax.plot(m, prof.week1_tps, lw=0.4, label="published (BurstGPT_1, week 1)")
    tps = np.bincount(np.floor(week.arrival_s / 60).astype(int),
                      weights=(week.prompt_tokens + week.output_tokens).astype(float),
                      minlength=7 * 1440)[:7 * 1440] / 60.0
    ax.plot(m, -tps, lw=0.4, color="C3", label='synthetic, "observed" (drawn negative)')
    ax.set_xlabel("day")
    ax.set_ylabel("tokens/s per minute")
    ax.set_title(f"week-1 token throughput: CV {pub['minute_tps_cv']:.2f} vs "
                 f"{st_w['minute_tps_cv']:.2f}, idle minutes {100 * pub['minute_zero_frac']:.0f} %"
                 f" vs {100 * st_w['minute_zero_frac']:.0f} %", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    ax = axes[1, 1]
    bins = np.geomspace(8, 4000, 25)
    ax.hist(prof.prompt, bins=bins, alpha=0.5, density=True, label="29 real rows: prompt")
    ax.hist(prof.output, bins=bins, alpha=0.5, density=True, label="29 real rows: output")
    logn = burstgpt_like(seed + 3, days=2, profile=prof, tokens="lognormal")
    ax.hist(logn.prompt_tokens, bins=bins, histtype="step", density=True, color="C0", lw=1.5,
            label='tokens="lognormal": prompt')
    ax.hist(logn.output_tokens, bins=bins, histtype="step", density=True, color="C1", lw=1.5,
            label='tokens="lognormal": output')
    ax.set_xscale("log")
    ax.set_xlabel("tokens")
    ax.set_title('tokens (default "empirical" resamples the 29 rows)', fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle("BurstGPT: published aggregates vs synthetic burstgpt_like (not real requests)",
                 fontsize=10)
    fig.tight_layout()
    path = out / "traces_burstgpt.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    rows = []
    keys = ("hour_peak_to_mean", "hour_peak_to_valley", "peak_hour", "valley_hour",
            "daily_log_slope", "mean_rate", "minute_tps_cv", "minute_zero_frac",
            "minute_peak_to_mean")
    for label, s in (("published aggregates", pub), ('synthetic, 61 days, "trend"', st_t),
                     ('synthetic, 61 days, "observed"', st_o),
                     ('synthetic, 7 days, "observed"', st_w)):
        rows.append("| " + label + " | " + " | ".join(
            f"{s[k]:.4g}" if isinstance(s[k], float) else str(s[k]) for k in keys) + " |")
    table = ("| | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys) + "\n"
             + "\n".join(rows) + "\n")
    return path, table


def busy_fractions(tr, targets=(0.3, 0.6, 0.9), window=1024):
    """Measured busy fraction (busy GPU-seconds / (GPUs x makespan)) of the default Routing-v0
    cluster under JSQ, replaying windows of the trace rescaled to each offered load (each
    window an episode that starts empty and drains)."""


    def jsq(key, obs, state, params):
        c = state.cluster
        return jnp.argmin(c.queues.count + c.servers.run_count).astype(jnp.int32)

    env, params = jaxserve.make("Routing-v0")
    gpus = routing_gpus()
    rows = []
    for rho in targets:
        scaled, f = rescale_to_load(tr, gpus, rho)
        out = replay_windows(env, params, windows(scaled, window), jsq,
                             key=jax.random.PRNGKey(0))
        busy = float(np.asarray(out["busy_time"]).sum())
        elapsed = float(np.asarray(out["makespan"]).sum())
        arrived = float(np.asarray(out["arrived"]).sum())
        rows.append((rho, f, busy / (len(gpus) * elapsed),
                     float(np.asarray(out["dropped"]).sum()) / arrived,
                     float(np.asarray(out["latency_sum"]).sum())
                     / max(float(np.asarray(out["completed"]).sum()), 1.0)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces-dir", type=Path, default=None,
                    help="a folder laid out like the trace mirror (default: $JAXSERVE_TRACES_DIR, "
                         "then the user cache)")
    ap.add_argument("--out", type=Path, default=Path("docs/figures"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-replay", action="store_true")
    args = ap.parse_args(argv)
    root = args.traces_dir  # None: jaxserve.traces.path
    args.out.mkdir(parents=True, exist_ok=True)
    reports, token_reports, traces = [], [], {}
    for name, title, rel, kw in AZURE:
        tr = load(resolve(rel, root), **kw)
        traces[name] = tr
        fit = fit_workload(tr, seed=args.seed)
        path = plot_fitted(name, title, tr, fit, args.out, args.seed)
        p = fit.mmpp.params
        print(f"{title}: MMPP l1={p['l1']:.6g} l2={p['l2']:.6g} r12={p['r12']:.6g} "
              f"r21={p['r21']:.6g} exact={fit.mmpp.exact} {fit.mmpp.notes} -> {path} "
              f"({path.stat().st_size // 1024} KB)")
        reports.append((title, fit.report))
        emp = fit_report(tr, fit.arrivals, fit_tokens(tr, "empirical"), seed=args.seed)
        token_reports += [(f"{title}, lognormal", fit.report), (f"{title}, empirical", emp)]
    print()
    print(fit_table(reports, ARRIVAL_KEYS))
    print(fit_table(token_reports, TOKEN_KEYS))
    prof = burstgpt_profile(root)
    path, table = plot_burstgpt(prof, args.out, args.seed)
    print(f"BurstGPT -> {path} ({path.stat().st_size // 1024} KB)\n")
    print(table)
    clusters = {"Routing-v0 default (2 fast + 2 slow)": routing_gpus(),
                "2 x h100-llama2-70b-tp4 + 2 x a100-llama2-70b-tp4":
                    [get_profile("h100-llama2-70b-tp4")] * 2
                    + [get_profile("a100-llama2-70b-tp4")] * 2}
    print("| trace | " + " | ".join(clusters) + " |\n|---|" + "---|" * len(clusters))
    for name, title, _, _ in AZURE[:2]:
        print(f"| {title} | " + " | ".join(f"{offered_load(traces[name], g):.3f}"
                                            for g in clusters.values()) + " |")
    if not args.no_replay:
        print("\n| offered load | time factor f | busy fraction (JSQ) | dropped "
              "| mean latency (s) |\n|---|---|---|---|---|")
        for rho, f, busy, drop, lat in busy_fractions(traces["azure_conv"]):
            print(f"| {rho:.2f} | {f:.3f} | {busy:.3f} | {100 * drop:.2f} % | {lat:.2f} |")


if __name__ == "__main__":
    main()
