"""Summary statistics of a loaded trace (`jaxserve.core.types.Trace`): request counts and
rate, inter-arrival and burstiness figures over windows, token-length quantiles and the
prompt/output correlations, and a table of several traces side by side (docs/traces.md).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from jaxserve.core.types import Trace, validate_trace


def _window_counts(t: np.ndarray, w: float) -> np.ndarray:
    """Counts per window [t0 + k w, t0 + (k+1) w), k = 0..K-1, K = max(1, ceil(span / w)).

    Empty windows are included. An arrival at exactly t0 + K w (the span is a multiple of w)
    falls in the last window, which is therefore closed on the right.
    """
    rel = t - t[0]
    span = float(rel[-1])
    k_windows = max(1, int(math.ceil(span / w)))
    idx = np.minimum(np.floor(rel / w).astype(np.int64), k_windows - 1)
    return np.bincount(idx, minlength=k_windows)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if x.shape[0] < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    x = x - x.mean()
    y = y - y.mean()
    den = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
    return float((x * y).sum() / den) if den > 0 else float("nan")


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their ranks), 1-based."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    ranks = np.empty(x.shape[0], dtype=np.float64)
    bounds = np.flatnonzero(np.diff(xs) != 0) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [x.shape[0]]])
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def summary(trace: Trace, windows_s: Sequence[float] = (1.0, 60.0)) -> dict[str, float]:
    """Arrival and token statistics of a trace, as a flat dict of Python numbers.

    Keys (times in seconds, rates in requests per second, tokens in tokens):

    * ``rows``: N; ``span_s``: last - first arrival (s).
    * ``mean_rate``: (N - 1) / span_s (req/s); NaN when span_s == 0.
    * ``cv_interarrival``: std / mean of the N - 1 gaps (population std); NaN if undefined.
    * for each window length w in `windows_s` (suffix ``_1s``, ``_60s``, ...): ``windows_``
      (number of windows K = max(1, ceil(span/w))), ``peak_count_`` (max arrivals in one
      window), ``peak_to_mean_`` (max / mean count) and ``iod_`` (index of dispersion, var /
      mean of the counts, population variance; 1 for Poisson). Windows are
      [t0 + k w, t0 + (k+1) w), empty ones included; the last arrival is counted in the last
      window even when it falls exactly on its right edge.
    * ``prompt_mean``, ``prompt_p50``, ``prompt_p90``, ``prompt_p99`` and the same for
      ``output_`` (numpy linear-interpolation percentiles).
    * ``corr_pearson``, ``corr_spearman`` (average ranks for ties), ``corr_pearson_log1p``
      between prompt and output tokens; NaN when either is constant.
    """
    tr = validate_trace(trace)
    t = tr.arrival_s
    n = int(t.shape[0])
    span = float(t[-1] - t[0])
    out: dict[str, float] = {"rows": n, "span_s": span}
    out["mean_rate"] = (n - 1) / span if span > 0 else float("nan")
    gaps = np.diff(t)
    gm = float(gaps.mean()) if gaps.shape[0] else 0.0
    out["cv_interarrival"] = float(gaps.std()) / gm if gm > 0 else float("nan")
    for w in windows_s:
        if not (w > 0):
            raise ValueError(f"window lengths must be > 0, got {w}")
        c = _window_counts(t, float(w)).astype(np.float64)
        tag = f"{w:g}s"
        out[f"windows_{tag}"] = int(c.shape[0])
        out[f"peak_count_{tag}"] = int(c.max())
        out[f"peak_to_mean_{tag}"] = float(c.max() / c.mean())
        out[f"iod_{tag}"] = float(c.var() / c.mean())
    for name, v in (("prompt", tr.prompt_tokens), ("output", tr.output_tokens)):
        v = v.astype(np.float64)
        out[f"{name}_mean"] = float(v.mean())
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = float(np.percentile(v, q))
    pr = tr.prompt_tokens.astype(np.float64)
    po = tr.output_tokens.astype(np.float64)
    out["corr_pearson"] = _pearson(pr, po)
    out["corr_spearman"] = _pearson(_ranks(pr), _ranks(po))
    out["corr_pearson_log1p"] = _pearson(np.log1p(pr), np.log1p(po))
    return out


def summary_table(named: Sequence[tuple[str, Trace]]) -> str:
    """A markdown table (two blocks: arrivals, tokens) of `summary` for named traces."""
    rows_a = ["| trace | N | span (s) | mean rate (req/s) | CV inter-arrival | peak/mean 1 s "
              "(peak) | peak/mean 60 s (peak) | IoD 1 s | IoD 60 s |",
              "|---|---|---|---|---|---|---|---|---|"]
    rows_t = ["| trace | prompt mean / p50 / p90 / p99 | output mean / p50 / p90 / p99 | "
              "corr Pearson / Spearman / Pearson log1p |", "|---|---|---|---|"]
    for name, tr in named:
        s = summary(tr)
        rows_a.append(
            f"| {name} | {s['rows']} | {s['span_s']:.2f} | {s['mean_rate']:.4f} | "
            f"{s['cv_interarrival']:.3f} | {s['peak_to_mean_1s']:.2f} ({s['peak_count_1s']}) | "
            f"{s['peak_to_mean_60s']:.3f} ({s['peak_count_60s']}) | {s['iod_1s']:.3f} | "
            f"{s['iod_60s']:.2f} |")
        tok = lambda k: (f"{s[k + '_mean']:.1f} / {s[k + '_p50']:g} / {s[k + '_p90']:g} / "
                         f"{s[k + '_p99']:g}")
        rows_t.append(f"| {name} | {tok('prompt')} | {tok('output')} | "
                      f"{s['corr_pearson']:.3f} / {s['corr_spearman']:.3f} / "
                      f"{s['corr_pearson_log1p']:.3f} |")
    return "\n".join(rows_a) + "\n\n" + "\n".join(rows_t)
