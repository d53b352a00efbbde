"""Matplotlib figures of evaluation results (host side; no pyplot global state).

Each function takes the dicts returned by `evaluate_many` / `sweep_rates`, writes one PNG and
returns its path.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _save(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


@contextlib.contextmanager
def axes_row(path, ncols: int = 1, figsize=(7, 4.2)):
    """Yields `(fig, axes)`: a figure with `ncols` axes side by side (a 1-D array); on a clean
    exit the figure is laid out and written to `path` as a PNG (parents created)."""
    fig = Figure(figsize=figsize)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    yield fig, axes
    fig.tight_layout()
    _save(fig, path)


def latency_cdf(results: Mapping[str, dict], path, title: str = "") -> Path:
    """Empirical CDF of request latency, one line per policy (log-scaled time axis)."""
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.add_subplot()
    for name, r in results.items():
        lat = np.sort(np.asarray(r["latencies"], np.float64))
        if lat.size == 0:
            continue
        ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=name, lw=1.4)
    slo = next(iter(results.values())).get("slo_s") if results else None
    if slo:
        ax.axvline(slo, color="k", ls=":", lw=1, label=f"SLO {slo:g} s")
    ax.set_xscale("log")
    ax.set_xlabel("latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.001)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title or "latency CDF")
    return _save(fig, path)


def load_sweep(sweep: Mapping[str, Sequence[dict]], path, title: str = "") -> Path:
    """p99 latency (dropped requests as infinitely late) and goodput vs arrival rate."""
    fig = Figure(figsize=(11, 4.2))
    ax_p, ax_g = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    slo = None
    for name, rows in sweep.items():
        rate = [r["rate"] for r in rows]
        p99 = np.array([r["p99_with_drops"] for r in rows], np.float64)
        finite = np.isfinite(p99)
        # Rates where over 1% of requests were dropped have an infinite p99: not drawn.
        line, = ax_p.plot(np.asarray(rate)[finite], p99[finite], marker="o", ms=3, label=name)
        ax_g.errorbar(rate, [r["goodput"] for r in rows],
                      yerr=[np.nan_to_num(r["goodput_ci95"]) for r in rows], marker="o", ms=3,
                      capsize=2, label=name, color=line.get_color())
        slo = rows[0]["slo_s"] if rows else slo
    if slo:
        ax_p.axhline(slo, color="k", ls=":", lw=1, label=f"SLO {slo:g} s")
    ax_p.set_yscale("log")
    ax_p.set_xlabel("arrival rate (req/s)")
    ax_p.set_ylabel("p99 latency (s), drops = infinitely late")
    ax_g.set_xlabel("arrival rate (req/s)")
    ax_g.set_ylabel("goodput (req/s within SLO)")
    for ax in (ax_p, ax_g):
        ax.grid(alpha=0.3)
    ax_g.legend(fontsize=7)
    fig.suptitle(title or "latency and goodput vs load")
    return _save(fig, path)


def class_mix(results: Mapping[str, dict], path, class_labels: Sequence[str] | None = None,
              title: str = "") -> Path:
    """Routing: requests each GPU received, stacked by size class, one group of bars per policy."""
    names = list(results)
    mixes = [np.asarray(results[n]["class_mix"], np.float64) for n in names]
    num_gpus, num_classes = mixes[0].shape
    labels = class_labels or [f"class {c}" for c in range(num_classes)]
    fig = Figure(figsize=(max(6.0, 1.1 * len(names) * max(num_gpus, 2) / 2), 4.5))
    ax = fig.add_subplot()
    width = 0.8 / num_gpus
    colors = [f"C{c}" for c in range(num_classes)]
    for p, mix in enumerate(mixes):
        share = mix / max(mix.sum(), 1.0)
        for g in range(num_gpus):
            x = p + (g - (num_gpus - 1) / 2) * width
            bottom = 0.0
            for c in range(num_classes):
                ax.bar(x, share[g, c], width * 0.9, bottom=bottom, color=colors[c],
                       label=labels[c] if (p == 0 and g == 0) else None)
                bottom += share[g, c]
            if p == 0:
                ax.text(x, bottom, f"{g}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("share of all requests (bars: GPU 0..N-1)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title or "size mix received by each GPU")
    return _save(fig, path)
