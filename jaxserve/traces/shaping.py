"""Shaping real traces for RL: load rescaling, fixed-length windows, and batched window replay.

Offered load (the definition used by `offered_load` and `rescale_to_load`)
--------------------------------------------------------------------------
For a trace with `N` requests over a span `T` (first to last arrival), mean prompt `p` and mean
output `o` tokens, and a cluster of GPUs `g` with profiles (`docs/contract_static.md`):

* arrival rate `lam = (N - 1) / T` (req/s; the `mean_rate` of `jaxserve.traces.summary`);
* a GPU's nominal capacity `mu_g = B_g / T_g` (req/s), where `T_g` is the service time of a
  **full batch of `B_g = max_batch` mean requests** (each with `p` prompt and `o` output
  tokens):
  `T_g = c0 + alpha B p + alpha2 B p^2 + o (beta + gamma B + delta B p)`;
* cluster capacity `C = sum_g mu_g`;
* **offered load `rho = lam / C`**.

`rho` is a property of the trace and the cluster alone (no policy, no simulation), linear in
the arrival rate, and it is the load at which full batches of average requests would keep
every GPU busy. It is a nominal figure: real static batches are not always full, and a batch
runs for its *longest* output, not the mean, so the busy fraction measured in a replay is
higher than `rho` and a cluster saturates below `rho = 1` (how far below depends on the
routing policy and on the spread of output lengths).

`rescale_to_load(trace, gpus, target)` multiplies every inter-arrival gap by one factor
`f = rho / target`, which divides `lam` by `f` and leaves the token sizes, the order of
requests and the burst shape (the gap CV, the relative profile of the rate over time) as they
were; time-window statistics such as the IoD change with the time scale, exactly as they would
for the same trace played faster or slower. The rescaled trace's `offered_load` equals
`target` up to float64 round-off.

Windows (`windows`)
-------------------
A long trace is cut into many short episodes with a fixed shape `(W, window_len)` (a
`TraceArrays` with a leading window axis), ready for `jax.vmap` over
`params.replace(trace=window)` with `env.replace_static(trace_len=window_len)`:

* ``by="requests"`` (default): window `w` holds requests `[w * stride, w * stride +
  window_len)`; with the default `stride = window_len` consecutive windows tile the trace and
  every request is in exactly one window. The last window may be shorter: its rows past
  `length` are padding (`gap 0, prompt 1, output 1`, never replayed). With `stride <
  window_len` windows overlap; with `stride > window_len` requests between windows are
  skipped; windows start at `0, stride, 2 stride, ...` until one reaches the end of the trace.
* ``by="time"``: `window_len` is a time span in seconds; window `k` holds the requests with
  arrival in `[t0 + k * window_len, t0 + (k + 1) * window_len)` (the last arrival counts in
  the last window, as in `summary`). Windows with no request are left out. Every window is
  padded to the largest count (or to `pad_to`). Windows tile the trace exactly once;
  `stride` (seconds) works as above.

Each window is rebased: its first gap is 0 (the episode starts at its first request). With
`return_starts=True`, `windows` also returns each window's first-row index and its first
arrival (float64 s) in the trace, from which the trace can be rebuilt exactly.

Windows are replayed as episodes, all at once under `jax.vmap`, by
`jaxserve.evaluation.replay.replay_windows` (traces/ sits below evaluation/).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxserve.core.service import full_batch_rate
from jaxserve.core.types import Trace, validate_trace
from jaxserve.core.sources import TraceArrays

__all__ = [
    "cluster_capacity",
    "offered_load",
    "rescale_to_load",
    "windows",
    "window_trace",
]


# ---------------------------------------------------------------------------------------------
# Load.
# ---------------------------------------------------------------------------------------------

def cluster_capacity(gpus: Any, mean_prompt: float, mean_output: float) -> np.ndarray:
    """Nominal capacity `mu_g = B_g / T_g` (req/s) of each GPU: a full batch of `max_batch`
    requests of `mean_prompt` / `mean_output` tokens (module docstring;
    `core.service.full_batch_rate` at mean sizes). `(num_gpus,)`."""
    return full_batch_rate(gpus, float(mean_prompt), float(mean_output))


def _rate_and_means(trace: Trace) -> tuple[Trace, float, float, float]:
    tr = validate_trace(trace, min_len=2)
    span = float(tr.arrival_s[-1] - tr.arrival_s[0])
    if span <= 0:
        raise ValueError("the trace's arrivals span zero time; its arrival rate is undefined")
    return (tr, (len(tr) - 1) / span, float(tr.prompt_tokens.mean()),
            float(tr.output_tokens.mean()))


def offered_load(trace: Trace, gpus: Any, *, mean_prompt: float | None = None,
                 mean_output: float | None = None) -> float:
    """Offered load `rho = lam / sum_g mu_g` of a trace on a cluster (module docstring).

    Args:
      trace: at least 2 requests over a positive span.
      gpus: a list of `GPUProfile`, or one (scalar or stacked `(num_gpus,)`) profile.
      mean_prompt: prompt tokens for the capacity (default: the trace's mean).
      mean_output: output tokens for the capacity (default: the trace's mean).
    """
    tr, lam, p, o = _rate_and_means(trace)
    p = p if mean_prompt is None else float(mean_prompt)
    o = o if mean_output is None else float(mean_output)
    return float(lam / cluster_capacity(gpus, p, o).sum())


def rescale_to_load(trace: Trace, gpus: Any, target_utilisation: float, *,
                    mean_prompt: float | None = None,
                    mean_output: float | None = None) -> tuple[Trace, float]:
    """Stretches or compresses time so that the trace's offered load is `target_utilisation`.

    Every arrival becomes `a_0 + f (a_i - a_0)`: inter-arrival gaps are multiplied by
    `f = offered_load(trace) / target_utilisation` (f > 1 slows the trace down). Token counts
    and request order are unchanged.

    Args:
      trace: the trace (at least 2 requests over a positive span).
      gpus: the cluster (list of `GPUProfile` or a stacked profile).
      target_utilisation: the offered load to reach, > 0 (see the module docstring; values
        near or above 1 overload the cluster).
      mean_prompt: as in `offered_load`.
      mean_output: as in `offered_load`.

    Returns:
      (rescaled trace, factor f).
    """
    target = float(target_utilisation)
    if not np.isfinite(target) or target <= 0:
        raise ValueError(f"target_utilisation must be a positive number, got {target_utilisation}")
    tr, _, _, _ = _rate_and_means(trace)
    rho = offered_load(tr, gpus, mean_prompt=mean_prompt, mean_output=mean_output)
    f = rho / target
    a0 = tr.arrival_s[0]
    arr = a0 + (tr.arrival_s - a0) * f
    return Trace(arrival_s=arr, prompt_tokens=tr.prompt_tokens.copy(),
                 output_tokens=tr.output_tokens.copy()), float(f)


# ---------------------------------------------------------------------------------------------
# Windows.
# ---------------------------------------------------------------------------------------------

def _starts(n: int, window_len: int, stride: int) -> np.ndarray:
    out = [0]
    while out[-1] + window_len < n and out[-1] + stride < n:
        out.append(out[-1] + stride)
    return np.asarray(out, np.int64)


def windows(trace: Trace, window_len: float, stride: float | None = None, *,
            by: str = "requests", pad_to: int | None = None,
            return_starts: bool = False
            ) -> TraceArrays | tuple[TraceArrays, np.ndarray, np.ndarray]:
    """Cuts a trace into fixed-shape windows, each rebased to start at its first request.

    Args:
      trace: the trace.
      window_len: requests per window (``by="requests"``, an int >= 1) or seconds per window
        (``by="time"``).
      stride: distance between window starts, in the same unit (default `window_len`: the
        windows tile the trace, each request in exactly one window).
      by: ``"requests"`` or ``"time"`` (module docstring).
      pad_to: rows per window (default: `window_len` by requests, the largest window by time).
      return_starts: also return `(first_row (W,) int64, first_arrival (W,) float64)`.

    Returns:
      `TraceArrays` with `gap, prompt, output` of shape `(W, L)` float32 and `length (W,)`
        int32 (valid rows per window; rows past it are padding), or `(TraceArrays, first_row,
        first_arrival)` with `return_starts=True`.
    """
    tr = validate_trace(trace)
    n = len(tr)
    if by == "requests":
        wl = int(window_len)
        if wl != window_len or wl < 1:
            raise ValueError(f"window_len must be an integer >= 1 request, got {window_len}")
        st = wl if stride is None else int(stride)
        if stride is not None and (st != stride or st < 1):
            raise ValueError(f"stride must be an integer >= 1 request, got {stride}")
        first = _starts(n, wl, st)
        last = np.minimum(first + wl, n)
    elif by == "time":
        w = float(window_len)
        if not np.isfinite(w) or w <= 0:
            raise ValueError(f"window_len must be a positive number of seconds, got {window_len}")
        st = w if stride is None else float(stride)
        if not np.isfinite(st) or st <= 0:
            raise ValueError(f"stride must be a positive number of seconds, got {stride}")
        t = tr.arrival_s - tr.arrival_s[0]
        span = float(t[-1])
        k = max(1, int(np.ceil(span / st))) if span > 0 else 1
        lo = np.arange(k) * st
        hi = lo + w
        first = np.searchsorted(t, lo, side="left")
        last = np.searchsorted(t, hi, side="left")
        last = np.where(hi >= span, np.where(lo <= span, n, last), last)  # last arrival counts
        keep = last > first
        first, last = first[keep], last[keep]
        wl = None
    else:
        raise ValueError(f"by must be 'requests' or 'time', got {by!r}")
    counts = last - first
    if first.shape[0] == 0:
        raise ValueError("no window holds a request")
    if pad_to is None:
        pad = wl if wl is not None else int(counts.max())
    else:
        pad = int(pad_to)
        if pad < counts.max():
            raise ValueError(f"pad_to={pad_to} is shorter than the longest window "
                             f"({int(counts.max())} requests)")
    idx = first[:, None] + np.arange(pad)[None, :]
    valid = idx < last[:, None]
    idx_c = np.minimum(idx, n - 1)
    gaps_all = np.zeros(n)
    gaps_all[1:] = np.diff(tr.arrival_s)
    gap = np.where(valid, gaps_all[idx_c], 0.0)
    gap[:, 0] = 0.0
    prompt = np.where(valid, tr.prompt_tokens[idx_c], 1)
    output = np.where(valid, tr.output_tokens[idx_c], 1)
    arrays = TraceArrays(gap=jnp.asarray(gap, jnp.float32),
                         prompt=jnp.asarray(prompt, jnp.float32),
                         output=jnp.asarray(output, jnp.float32),
                         length=jnp.asarray(counts, jnp.int32))
    if return_starts:
        return arrays, first.astype(np.int64), tr.arrival_s[first].astype(np.float64)
    return arrays


def window_trace(wins: TraceArrays, index: int, start: float = 0.0) -> Trace:
    """Window `index` of `wins` as a host `Trace` (its valid rows), first arrival at `start`.

    Arrivals are `start + cumsum(gap)` in float64 over the window's float32 gaps.
    """
    n = int(np.asarray(wins.length)[index])
    gap = np.asarray(wins.gap[index, :n], np.float64)
    return Trace(arrival_s=float(start) + np.cumsum(gap),
                 prompt_tokens=np.asarray(wins.prompt[index, :n]).astype(np.int64),
                 output_tokens=np.asarray(wins.output[index, :n]).astype(np.int64))
