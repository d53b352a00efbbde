"""A **synthetic** BurstGPT-shaped workload generator.

The full BurstGPT trace (`HPMLL/BurstGPT`, `BurstGPT_1.csv`, 1.43 M requests over 61 days) is
not available here; only its first 30 real rows and a third party's published aggregates of
the whole file are (registry entries "burstgpt_first30" and "burstgpt_aggregates" of
`jaxserve.traces.registry`: `jaxserve-traces fetch burstgpt_first30 burstgpt_aggregates`
downloads them; `../shared/traces/README.md` beside the repository tells how they were made).
`burstgpt_like` generates synthetic traces whose *aggregates* follow those published numbers.
Its requests are made up: no row of its output is a real request, and nothing beyond the
aggregates below should be read into it.

What it matches (aggregates of `BurstGPT_1_derived_aggregates_IsabellaLiu99.json`):

* **hour of day**: the `hourly_avg` profile (mean requests per hour of day over the 61 days;
  peak/mean 1.84 at 14 h, peak/valley 11.7);
* **day to day**: with ``day_profile="trend"`` (default) a smooth exponential growth whose rate
  is the least-squares slope of log daily request counts over the 61 `daily` entries
  (+2.1 %/day), scaled so that the 61-day mean equals the published mean day (23,438 requests,
  1,429,737 in total: 0.271 req/s); with ``"observed"`` the 61 published daily counts
  themselves (cycled after day 60; this keeps the trace's bursty days, e.g. day 9 with 149,520
  requests); with ``"flat"`` every day is the mean day;
* **short-term burstiness** (optional, on by default): a two-state Markov modulation of the
  rate (normal / burst), calibrated so that the first week with ``day_profile="observed"`` has
  about the published per-minute token-throughput CV (1.32) and share of minutes without a
  request (38 %) (see `DEFAULT_BURST`; `docs/traces.md` gives the measured numbers);
* **token lengths**: the 29 real non-failed rows of the 30-row file, drawn uniformly
  (``tokens="empirical"``, default), or a lognormal fitted to them (``"lognormal"``). Their mean
  total (965 tokens per request) is above the full trace's published 734 (the rows are from
  the first 40 minutes of day 0); pass `token_scale` to rescale.

Model: arrivals are a non-homogeneous Poisson process (an MMPP when bursts are on) with rate

    lambda(t) = rate_scale * N_day(t) / 86400 * H[hour(t)] * Z(t),

`H` the hourly profile normalised to mean 1, `N_day` the expected requests of the day and
`Z` the burst modulation (mean 1; `Z = 1` with ``burst=None``). Sampling is exact: the rate is
piecewise constant between hour boundaries and switches of `Z`; each piece gets a Poisson
number of uniformly placed arrivals.

Times: `arrival_s` is seconds since 00:00 of day `start_day` of the model (BurstGPT's
`Timestamp` convention), **not rebased**, so `hour = floor(arrival_s / 3600) mod 24`. Pass
``rebase=True`` for a trace starting at 0 like the loaders'.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.core.types import Trace
from jaxserve.traces.fitting import _rng, fit_tokens, sample_tokens_np
from jaxserve.traces.loaders import load_burstgpt
from jaxserve.traces.registry import REGISTRY
from jaxserve.traces.store import ENV_VAR, TraceNotFoundError, cache_dir, resolve

__all__ = [
    "BurstProfile",
    "DEFAULT_BURST",
    "burstgpt_like",
    "burstgpt_profile",
    "burstgpt_stats",
    "default_traces_dir",
    "published_stats",
]

AGGREGATES_FILE = REGISTRY["burstgpt_aggregates"].relpath  # relative paths as in the mirror
ROWS_FILE = REGISTRY["burstgpt_first30"].relpath

#: Burst modulation `(burst_fraction, ratio, mean_burst_s)`: the rate is in its burst state a
#: fraction `burst_fraction` of the time, `ratio` times its normal-state rate, for exponential
#: sojourns of mean `mean_burst_s` seconds (normal sojourns: `mean_burst_s * (1 - f) / f`).
#: Chosen by a grid search (fractions 0.1-0.5, ratios 3-30, sojourns 2 min-1 h) for the first
#: week with ``day_profile="observed"`` and empirical tokens to reproduce the published
#: per-minute token-throughput CV (1.32) and zero-minute share (38 %) of that week.
DEFAULT_BURST = (0.5, 10.0, 120.0)


def default_traces_dir() -> Path:
    """Kept for old callers; use `jaxserve.traces.path(name)` (it checks the file's hash).

    `$JAXSERVE_TRACES_DIR` if set, else the user cache folder that `jaxserve-traces fetch`
    fills (`jaxserve.traces.store.cache_dir()`); both are laid out like the trace mirror."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    root = cache_dir()
    if root is None:
        raise TraceNotFoundError(f"no trace folder: set {ENV_VAR} or pip install pooch and run "
                                 "`jaxserve-traces fetch --all`")
    return root


@dataclasses.dataclass(frozen=True)
class BurstProfile:
    """The aggregates `burstgpt_like` follows (derived from the published BurstGPT aggregates).

    Attributes:
      hourly: `(24,)` mean requests per hour of day (published `hourly_avg.rph`).
      daily: `(D,)` requests per day (published `daily.req`).
      daily_tokens: `(D,)` tokens per day (published `daily.tok`).
      trend_slope: least-squares slope of `log(daily)` against the day index (1/day).
      week1_tps: `(10080,)` tokens/s in each minute of the first week (absent minutes = 0).
      prompt, output: the real rows' token counts (failed rows dropped).
      source: where the numbers come from.
    """

    hourly: np.ndarray
    daily: np.ndarray
    daily_tokens: np.ndarray
    trend_slope: float
    week1_tps: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    source: str

    @property
    def mean_daily(self) -> float:
        return float(self.daily.mean())


def burstgpt_profile(traces_dir: Any = None) -> BurstProfile:
    """Reads the BurstGPT aggregates JSON and the 30 real rows (registry entries
    "burstgpt_aggregates" and "burstgpt_first30") from `traces_dir`, a folder laid out like the
    trace mirror, or by default with `jaxserve.traces.path` (`$JAXSERVE_TRACES_DIR`, then the
    user cache). Raises FileNotFoundError (`TraceNotFoundError`) naming the missing file and
    `jaxserve-traces fetch NAME`."""
    try:
        agg_path = resolve("burstgpt_aggregates", traces_dir)
        rows_path = resolve("burstgpt_first30", traces_dir)
    except TraceNotFoundError as e:
        raise TraceNotFoundError(f"BurstGPT data file not found: {e} (or pass profile=)") from None
    with open(agg_path, encoding="utf-8") as fh:
        agg = json.load(fh)
    hourly = np.zeros(24)
    for r in agg["hourly_avg"]:
        hourly[int(r["h"])] = float(r["rph"])
    days = sorted(agg["daily"], key=lambda r: int(r["d"]))
    daily = np.array([float(r["req"]) for r in days])
    daily_tok = np.array([float(r["tok"]) for r in days])
    d = np.arange(daily.shape[0], dtype=np.float64)
    slope = float(np.polyfit(d, np.log(np.maximum(daily, 1.0)), 1)[0])
    tps = np.zeros(7 * 1440)
    for r in agg["week1_min"]:
        if 0 <= int(r["t"]) < tps.shape[0]:
            tps[int(r["t"])] = float(r["tps"])
    rows = load_burstgpt(rows_path, failed="drop")
    return BurstProfile(hourly=hourly, daily=daily, daily_tokens=daily_tok, trend_slope=slope,
                        week1_tps=tps, prompt=rows.prompt_tokens.copy(),
                        output=rows.output_tokens.copy(), source=str(agg_path))


def _daily_expected(profile: BurstProfile, day_profile: str, day_index: np.ndarray) -> np.ndarray:
    if day_profile == "observed":
        return profile.daily[day_index % profile.daily.shape[0]]
    if day_profile == "flat":
        return np.full(day_index.shape, profile.mean_daily)
    if day_profile == "trend":
        d = np.arange(profile.daily.shape[0], dtype=np.float64)
        c = profile.mean_daily / np.exp(profile.trend_slope * d).mean()
        return c * np.exp(profile.trend_slope * day_index)
    raise ValueError(f"day_profile must be 'trend', 'observed' or 'flat', got {day_profile!r}")


def _burst_path(rng: np.random.Generator, horizon: float, burst) -> tuple[np.ndarray, np.ndarray]:
    """Switch times (starting with 0) and the modulation value after each switch."""
    if burst is None:
        return np.zeros(1), np.ones(1)
    frac, ratio, mean_burst = (float(x) for x in burst)
    if not (0 < frac < 1) or ratio < 1 or mean_burst <= 0:
        raise ValueError(f"burst must be (fraction in (0, 1), ratio >= 1, mean_burst_s > 0), "
                         f"got {burst}")
    z_lo = 1.0 / (frac * ratio + 1.0 - frac)
    z = np.array([z_lo, ratio * z_lo])  # state 0 normal, 1 burst; mean 1
    dwell = np.array([mean_burst * (1.0 - frac) / frac, mean_burst])
    state = int(rng.random() < frac)
    times, states, t = [np.zeros(1)], [np.array([state])], 0.0
    while t < horizon:
        m = int(2 * horizon / dwell.sum()) + 16  # enough switches for the rest, in one go
        st = (state + np.arange(m)) % 2
        hold = rng.exponential(1.0, m) * dwell[st]
        ends = t + np.cumsum(hold)
        times.append(ends)
        states.append((st + 1) % 2)
        t, state = float(ends[-1]), int((st[-1] + 1) % 2)
    times, states = np.concatenate(times), np.concatenate(states)
    keep = times < horizon
    return times[keep], z[states[keep]]


def burstgpt_like(key_or_seed: Any, days: float, rate_scale: float = 1.0, *,
                  day_profile: str = "trend", burst: tuple | None = DEFAULT_BURST,
                  tokens: str = "empirical", token_scale: float = 1.0, start_day: int = 0,
                  rebase: bool = False, profile: BurstProfile | None = None,
                  traces_dir: Any = None) -> Trace:
    """A synthetic BurstGPT-shaped trace (see the module docstring: what is matched, and how).

    Args:
      key_or_seed: int seed, numpy Generator or jax PRNG key.
      days: length in days (> 0; fractional allowed).
      rate_scale: multiplies the rate (1.0: the published volume, 0.271 req/s on average
        over 61 days with the default trend).
      day_profile: ``"trend"`` (exponential growth fitted to the daily counts), ``"observed"``
        (the published daily counts) or ``"flat"``.
      burst: `(burst_fraction, ratio, mean_burst_s)` of the two-state burst modulation, or
        None for a plain non-homogeneous Poisson process (`DEFAULT_BURST`).
      tokens: ``"empirical"`` (the 29 real rows) or ``"lognormal"`` (fitted to them).
      token_scale: multiplies every token count (rounded, at least 1).
      start_day: model day of `t = 0` (selects the day of the trend or of the observed counts).
      rebase: subtract the first arrival (first request at 0).
      profile: the aggregates to follow (default `burstgpt_profile(traces_dir)`).
      traces_dir: a folder laid out like the trace mirror (default: `jaxserve.traces.path`,
        i.e. `$JAXSERVE_TRACES_DIR`, then the user cache).

    Returns:
      `Trace` with float64 `arrival_s` (seconds since 00:00 of `start_day` unless `rebase`).
    """
    days = float(days)
    if not np.isfinite(days) or days <= 0:
        raise ValueError(f"days must be a positive number, got {days}")
    if not np.isfinite(rate_scale) or rate_scale <= 0:
        raise ValueError(f"rate_scale must be a positive number, got {rate_scale}")
    if token_scale <= 0:
        raise ValueError(f"token_scale must be positive, got {token_scale}")
    prof = burstgpt_profile(traces_dir) if profile is None else profile
    rng = _rng(key_or_seed)
    horizon = days * 86400.0
    h_norm = prof.hourly / prof.hourly.mean()
    sw_t, sw_z = _burst_path(rng, horizon, burst)
    edges = np.unique(np.concatenate([np.arange(0.0, horizon, 3600.0), sw_t, [horizon]]))
    lo, hi = edges[:-1], edges[1:]
    hour = np.floor(lo / 3600.0).astype(np.int64)
    day = start_day + hour // 24
    lam = (rate_scale * _daily_expected(prof, day_profile, day) / 86400.0 * h_norm[hour % 24]
           * sw_z[np.searchsorted(sw_t, lo, side="right") - 1])
    cnt = rng.poisson(lam * (hi - lo))
    n = int(cnt.sum())
    if n == 0:
        raise ValueError("no request generated; increase days or rate_scale")
    arr = np.sort(np.repeat(lo, cnt) + np.repeat(hi - lo, cnt) * rng.random(n))
    if tokens == "empirical":
        idx = rng.integers(0, prof.prompt.shape[0], n)
        p, o = prof.prompt[idx].astype(np.float64), prof.output[idx].astype(np.float64)
    elif tokens == "lognormal":
        dist = fit_tokens(Trace(arrival_s=np.arange(prof.prompt.shape[0], dtype=np.float64),
                                prompt_tokens=prof.prompt, output_tokens=prof.output))
        p, o = (x.astype(np.float64) for x in sample_tokens_np(rng, dist, n))
    else:
        raise ValueError(f"tokens must be 'empirical' or 'lognormal', got {tokens!r}")
    if token_scale != 1.0:
        p, o = np.rint(p * token_scale), np.rint(o * token_scale)
    if rebase:
        arr = arr - arr[0]
    return Trace(arrival_s=arr, prompt_tokens=np.maximum(p, 1).astype(np.int64),
                 output_tokens=np.maximum(o, 1).astype(np.int64))


def burstgpt_stats(trace: Trace, *, start_s: float = 0.0) -> dict[str, Any]:
    """The aggregates `burstgpt_like` targets, measured on a trace (synthetic or real).

    Args:
      trace: arrival times in seconds since 00:00 of day 0 (minus `start_s`).

    Returns dict: `hourly` (24,) mean requests per hour of day over the whole days covered,
    `hour_peak_to_mean`, `hour_peak_to_valley`, `peak_hour`, `valley_hour`, `daily` (requests
    per day), `daily_log_slope` (least-squares slope of log daily counts, 1/day; NaN with
    fewer than 2 days), `mean_rate` (requests / covered seconds), and per-minute token
    throughput over the first `min(7, days)` days: `minute_tps_mean`, `minute_tps_cv`,
    `minute_zero_frac`, `minute_peak_to_mean`.
    """
    t = np.asarray(trace.arrival_s, np.float64) - float(start_s)
    tok = np.asarray(trace.prompt_tokens, np.float64) + np.asarray(trace.output_tokens, np.float64)
    ndays = max(1, int(np.ceil(t[-1] / 86400.0 - 1e-12)))
    hours = np.floor(t / 3600.0).astype(np.int64)
    by_hour = np.bincount(hours, minlength=ndays * 24)[:ndays * 24].reshape(ndays, 24)
    hourly = by_hour.mean(0)
    daily = by_hour.sum(1).astype(np.float64)
    slope = (float(np.polyfit(np.arange(ndays), np.log(np.maximum(daily, 1.0)), 1)[0])
             if ndays >= 2 else float("nan"))
    w = min(7, ndays) * 1440
    minutes = np.floor(t / 60.0).astype(np.int64)
    ok = minutes < w
    tps = np.bincount(minutes[ok], weights=tok[ok], minlength=w)[:w] / 60.0
    return {
        "hourly": hourly,
        "hour_peak_to_mean": float(hourly.max() / hourly.mean()),
        "hour_peak_to_valley": float(hourly.max() / max(hourly.min(), 1e-12)),
        "peak_hour": int(np.argmax(hourly)),
        "valley_hour": int(np.argmin(hourly)),
        "daily": daily,
        "daily_log_slope": slope,
        "mean_rate": float(t.shape[0] / (ndays * 86400.0)),
        "minute_tps_mean": float(tps.mean()),
        "minute_tps_cv": float(tps.std() / tps.mean()) if tps.mean() > 0 else float("nan"),
        "minute_zero_frac": float((tps == 0).mean()),
        "minute_peak_to_mean": float(tps.max() / tps.mean()) if tps.mean() > 0 else float("nan"),
    }


def published_stats(profile: BurstProfile | None = None) -> dict[str, Any]:
    """The same aggregates as `burstgpt_stats`, computed from the published numbers."""
    prof = burstgpt_profile() if profile is None else profile
    h = prof.hourly
    tps = prof.week1_tps
    return {
        "hourly": h.copy(),
        "hour_peak_to_mean": float(h.max() / h.mean()),
        "hour_peak_to_valley": float(h.max() / h.min()),
        "peak_hour": int(np.argmax(h)),
        "valley_hour": int(np.argmin(h)),
        "daily": prof.daily.copy(),
        "daily_log_slope": prof.trend_slope,
        "mean_rate": float(prof.daily.sum() / (prof.daily.shape[0] * 86400.0)),
        "minute_tps_mean": float(tps.mean()),
        "minute_tps_cv": float(tps.std() / tps.mean()),
        "minute_zero_frac": float((tps == 0).mean()),
        "minute_peak_to_mean": float(tps.max() / tps.mean()),
    }
