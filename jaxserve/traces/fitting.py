"""Fitting a synthetic workload (MMPP arrivals, token lengths) to a request trace.

A fitted workload is what an environment needs to generate unlimited fresh episodes that look
like a real trace: an `ArrivalProcess` (a Markov-modulated Poisson process) and a `TokenDist`,
both ready for `jaxserve.make(..., arrivals=..., tokens=...)`.

Arrivals: a two-phase MMPP fitted by moment matching (`fit_mmpp`)
--------------------------------------------------------------------
A 2-phase MMPP has four parameters: phase rates `l1 > l2 >= 0` and switching rates `r12`
(1 -> 2), `r21` (2 -> 1). Write `s = r12 + r21`, `pi1 = r21 / s`, `pi2 = r12 / s`,
`m = pi1 l1 + pi2 l2` (the mean rate) and `d = l1 - l2`. Four statistics of the trace are
matched exactly when possible:

1. the mean rate `(N - 1) / span` (as `jaxserve.traces.summary`);
2. the index of dispersion of counts (IoD, var/mean, population variance) in windows of
   `scales[0]` seconds, over **complete windows only** (`count_iod`);
3. the same IoD in windows of `scales[1]` seconds (default scales: 1 s and 60 s);
4. the coefficient of variation (CV) of the inter-arrival gaps (as `summary`).

Complete windows: `summary` (and `shared/traces/README.md`) count `ceil(span / w)` windows, the
last one partial; a short last window holds few requests and inflates the IoD at long
windows (the Azure conv trace's last minute is 22 s long: its 60 s IoD is 20.6 with it and
16.1 without). The MMPP formula below is for windows of equal length, so fits and reports use
`count_iod`, which drops the partial last window.

The MMPP's IoD of counts in a window of length t (Heffes and Lucantoni, 1986) is

    IoD(t) = 1 + A * f(s t),    A = 2 pi1 pi2 d^2 / (m s),    f(x) = 1 - (1 - exp(-x)) / x,

so the two IoDs fix the switching speed `s` (from the ratio `(IoD(t2) - 1) / (IoD(t1) - 1)
= f(s t2) / f(s t1)`, which falls from `t2 / t1` at s -> 0 to 1 at s -> inf: a bisection in
log s) and the amplitude `A`. With `m`, `s`, `A` fixed, one free parameter is left, `pi1`
(the share of time in the busy phase): `d = sqrt(A m s / (2 pi1 pi2))`, `l1 = m + pi2 d`,
`l2 = m - pi1 d` (`l2 >= 0` bounds `pi1`). It is chosen so that the gap CV of the MMPP
(a phase-type law, `E[X^k] = k! phi (-D0)^-k 1`, `phi` the phase law at arrivals) equals the
trace's: a search over a log grid of `pi1` refined by bisection.

When neither IoD is significantly above 1 (excess below 3 standard errors of a Poisson
process's IoD, `sqrt(2 / (K - 1))` for K windows) the fit is a Poisson process at the mean
rate (`exact` False, noted). When the trace's numbers are outside what a 2-phase MMPP can
produce (an IoD below 1, an IoD ratio outside `(1, t2/t1)`, or a CV the family cannot reach
for the given `A, s`), the nearest admissible value is used and `MMPPFit.exact` is False;
`MMPPFit.notes` says what was clipped.
The mean rate is always matched exactly.

Why moments, not EM: the four statistics are exactly what the environments' users look at
(load, burstiness at the scale of a decision and of a minute), the fit is closed-form and
deterministic, and it needs only the trace's summary, not a likelihood over 10^4 gaps.

Tokens (`fit_tokens`)
---------------------
``"lognormal"``: independent lognormal prompt and output lengths, median `exp(mean log x)`,
sigma `std log x` (population), clipped to the trace's maxima (`core.arrivals.lognormal_tokens`
rounds and clips to `[1, max]`). ``"empirical"``: the trace's own `(prompt, output)` rows drawn
uniformly (keeps their joint law exactly; `core.arrivals.empirical_tokens`).

Checking a fit (`fit_report`)
-----------------------------
Samples are drawn from the fitted model (`sample_workload`, an exact numpy sampler of the
MMPP; `sample_arrivals_jax` is the engine's own `core.arrivals.sample_gap` under
`jax.lax.scan`, and the tests check that the two agree in law) and summarised with
`jaxserve.traces.summary` (IoDs by `count_iod`), the same statistics as the trace's. The report
also holds the model's analytic values (`mmpp_stats`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core import arrivals as A
from jaxserve.core.types import Trace, validate_trace
from jaxserve.traces.trace_stats import summary

__all__ = [
    "MMPPFit",
    "WorkloadFit",
    "fit_mmpp",
    "fit_tokens",
    "fit_workload",
    "fit_report",
    "fit_table",
    "count_iod",
    "mmpp_stats",
    "mmpp_gap_moments",
    "mmpp_iod",
    "sample_mmpp",
    "sample_arrivals_jax",
    "sample_tokens_np",
    "sample_workload",
]


# ---------------------------------------------------------------------------------------------
# Analytic statistics of an MMPP.
# ---------------------------------------------------------------------------------------------

def _as_np(proc: A.ArrivalProcess) -> tuple[np.ndarray, np.ndarray]:
    rates = np.asarray(proc.rates, np.float64).reshape(-1)
    k = rates.shape[0]
    off = np.asarray(proc.switch, np.float64).reshape(k, k) * (1.0 - np.eye(k))
    return rates, off - np.diag(off.sum(-1))


def _stationary_np(gen: np.ndarray) -> np.ndarray:
    k = gen.shape[0]
    if k == 1:
        return np.ones(1)
    a = gen.T.copy()
    a[-1] = 1.0
    b = np.zeros(k)
    b[-1] = 1.0
    return np.clip(np.linalg.solve(a, b), 0.0, 1.0)


def _expm(m: np.ndarray) -> np.ndarray:
    """Matrix exponential by scaling and squaring of a Taylor series (float64, small m)."""
    norm = np.abs(m).sum(-1).max()
    j = max(0, int(math.ceil(math.log2(norm))) + 1) if norm > 0 else 0
    x = m / (2.0 ** j)
    out = np.eye(m.shape[0])
    term = np.eye(m.shape[0])
    for i in range(1, 30):
        term = term @ x / i
        out = out + term
    for _ in range(j):
        out = out @ out
    return out


def mmpp_iod(proc: A.ArrivalProcess, t: float) -> float:
    """Index of dispersion (var/mean) of the MMPP's arrival count in a window of `t` seconds.

    Stationary start: `Var N(t) = m t + 2 int_0^t (t - u) C(u) du` with `C(u)` the
    autocovariance of the phase rate, `C(u) = sum_ij pi_i l_i [exp(Q u)]_ij l_j - m^2`; the
    double integral of `exp(Q u)` is a block of the exponential of a 3K x 3K matrix (Van Loan).
    """
    rates, gen = _as_np(proc)
    pi = _stationary_np(gen)
    m = float(pi @ rates)
    k = rates.shape[0]
    if k == 1 or t <= 0:
        return 1.0
    big = np.zeros((3 * k, 3 * k))
    big[:k, :k] = gen * t
    big[:k, k:2 * k] = np.eye(k) * t
    big[k:2 * k, 2 * k:] = np.eye(k) * t
    e = _expm(big)[:k, 2 * k:]  # int_0^t (t - u) exp(Q u) du
    var_integral = 2.0 * (float((pi * rates) @ e @ rates) - m * m * t * t / 2.0)
    return 1.0 + max(var_integral, 0.0) / (m * t)


def mmpp_gap_moments(proc: A.ArrivalProcess, orders: Sequence[int] = (1, 2)) -> list[float]:
    """Moments `E[X^k]` of the stationary inter-arrival gap of an MMPP (phase-type law).

    `E[X^k] = k! phi (-D0)^-k 1` with `D0 = Q - diag(rates)` and `phi = pi diag(rates) / m` the
    phase at an arrival.
    """
    rates, gen = _as_np(proc)
    pi = _stationary_np(gen)
    m = float(pi @ rates)
    phi = pi * rates / m
    inv = np.linalg.inv(-(gen - np.diag(rates)))
    out, v = [], np.ones(rates.shape[0])
    for kk in range(1, max(orders) + 1):
        v = inv @ v
        if kk in orders:
            out.append(math.factorial(kk) * float(phi @ v))
    return out


def mmpp_stats(proc: A.ArrivalProcess, scales: Sequence[float] = (1.0, 60.0)) -> dict[str, float]:
    """Analytic statistics of an MMPP, named like `jaxserve.traces.summary`'s keys.

    Returns `mean_rate` (req/s), `cv_interarrival` (of the stationary gap) and `iod_<w>s` for
    each window length `w` in `scales`.
    """
    rates, gen = _as_np(proc)
    m1, m2 = mmpp_gap_moments(proc, (1, 2))
    out = {"mean_rate": float(_stationary_np(gen) @ rates),
           "cv_interarrival": math.sqrt(max(m2 / (m1 * m1) - 1.0, 0.0))}
    for w in scales:
        out[f"iod_{_wname(w)}"] = mmpp_iod(proc, float(w))
    return out


def _wname(w: float) -> str:
    return f"{w:g}s"


def count_iod(trace: Trace, w: float) -> tuple[float, int]:
    """IoD (var/mean, population variance) of arrival counts in complete windows.

    Windows `[t0 + k w, t0 + (k + 1) w)` for `k < floor(span / w)` (`t0` the first arrival);
    arrivals after the last complete window are ignored. With no complete window (span < w)
    the whole trace is one window and the IoD is NaN. Returns `(iod, number of windows)`.
    """
    t = np.asarray(trace.arrival_s, np.float64)
    t = t - t[0]
    k = int(np.floor(t[-1] / float(w) + 1e-12))
    if k < 1:
        return float("nan"), 0
    idx = np.floor(t / float(w)).astype(np.int64)
    c = np.bincount(idx[idx < k], minlength=k).astype(np.float64)
    return (float(c.var() / c.mean()) if c.mean() > 0 else float("nan")), k


def _stats(trace: Trace, scales: Sequence[float] = (1.0, 60.0)) -> dict:
    """`summary(trace)` with `iod_<w>s` / `windows_<w>s` replaced by complete-window values."""
    st = summary(trace, windows_s=tuple(scales))
    for w in scales:
        st[f"iod_{_wname(w)}"], st[f"windows_{_wname(w)}"] = count_iod(trace, w)
    return st


# ---------------------------------------------------------------------------------------------
# Fitting.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class MMPPFit:
    """A fitted MMPP and how it was obtained.

    Attributes:
      arrivals: the fitted `ArrivalProcess` (phase 0 is the busy phase).
      targets: the trace statistics the fit aimed at (`mean_rate`, `cv_interarrival`,
        `iod_<w>s` over complete windows, `count_iod`).
      model: the same statistics of the fitted MMPP, analytic (`mmpp_stats`).
      exact: True when every target was attainable and is matched (to 1e-6 relative).
      notes: what was clipped when a target was outside the 2-phase family.
      params: `l1, l2, r12, r21` (req/s, 1/s) in float64.
    """

    arrivals: A.ArrivalProcess
    targets: dict
    model: dict
    exact: bool
    notes: list
    params: dict


def _f(x: np.ndarray | float) -> np.ndarray | float:
    """f(x) = 1 - (1 - exp(-x)) / x, with its series near 0."""
    x = np.asarray(x, np.float64)
    small = x < 1e-4
    xs = np.where(small, 1.0, x)
    return np.where(small, x / 2.0 - x * x / 6.0, 1.0 - (-np.expm1(-xs)) / xs)


def _mmpp2(m: float, s: float, amp: float, pi1: float) -> A.ArrivalProcess:
    pi2 = 1.0 - pi1
    d = math.sqrt(amp * m * s / (2.0 * pi1 * pi2))
    l1, l2 = m + pi2 * d, max(m - pi1 * d, 0.0)
    return A.ArrivalProcess(rates=np.array([l1, l2]),
                            switch=np.array([[0.0, s * pi2], [s * pi1, 0.0]]))


def _cv2(m: float, s: float, amp: float, pi1: float) -> float:
    m1, m2 = mmpp_gap_moments(_mmpp2(m, s, amp, pi1), (1, 2))
    return math.sqrt(max(m2 / (m1 * m1) - 1.0, 0.0))


def fit_mmpp(trace: Trace, scales: Sequence[float] = (1.0, 60.0), *,
             targets: dict | None = None) -> MMPPFit:
    """Fits a 2-phase MMPP to a trace by moment matching (see the module docstring).

    Args:
      trace: the trace (at least 3 requests, positive span).
      scales: two window lengths (s), `scales[0] < scales[1]`, whose IoDs are matched.
      targets: optional dict overriding the trace statistics (`mean_rate`,
        `cv_interarrival`, `iod_<w>s`), e.g. to fit published aggregates.

    Returns:
      `MMPPFit` with float32 `arrivals` ready for `jaxserve.make(arrivals=...)`.
    """
    t1, t2 = (float(w) for w in scales)
    if not (0 < t1 < t2):
        raise ValueError(f"scales must be two window lengths 0 < t1 < t2, got {scales}")
    tr = validate_trace(trace)
    if len(tr) < 3 or tr.arrival_s[-1] <= tr.arrival_s[0]:
        raise ValueError("fit_mmpp needs at least 3 requests over a positive time span")
    st = _stats(tr, (t1, t2))
    tgt = {"mean_rate": st["mean_rate"], "cv_interarrival": st["cv_interarrival"],
           f"iod_{_wname(t1)}": st[f"iod_{_wname(t1)}"],
           f"iod_{_wname(t2)}": st[f"iod_{_wname(t2)}"]}
    if targets:
        unknown = set(targets) - set(tgt)
        if unknown:
            raise ValueError(f"unknown fit target(s) {sorted(unknown)}; known: {sorted(tgt)}")
        tgt.update({k: float(v) for k, v in targets.items()})
    m = float(tgt["mean_rate"])
    cv = float(tgt["cv_interarrival"])
    e1 = float(tgt[f"iod_{_wname(t1)}"]) - 1.0
    e2 = float(tgt[f"iod_{_wname(t2)}"]) - 1.0
    notes: list[str] = []
    # Poisson counts in K windows give an IoD with standard error about sqrt(2 / (K - 1)).
    se = [math.sqrt(2.0 / max(st[f"windows_{_wname(w)}"] - 1, 1)) for w in (t1, t2)]
    if e2 <= 1e-9 or e1 <= 1e-9 or (e1 < 3 * se[0] and e2 < 3 * se[1]):
        notes.append(f"IoDs not significantly above 1 (iod_{_wname(t1)}={e1 + 1:.4g}, "
                     f"iod_{_wname(t2)}={e2 + 1:.4g}; 3 standard errors of a Poisson process: "
                     f"{3 * se[0]:.3g}, {3 * se[1]:.3g}): fitted a Poisson process")
        proc = A.poisson(m)
        model = mmpp_stats(proc, (t1, t2))
        return MMPPFit(arrivals=proc, targets=tgt, model=model, exact=False, notes=notes,
                       params={"l1": m, "l2": m, "r12": 0.0, "r21": 0.0})
    # 1) switching speed s from the IoD ratio; f(s t2) / f(s t1) decreases from t2/t1 to 1.
    ratio = e2 / e1
    lo_r, hi_r = 1.0 + 1e-6, t2 / t1 * (1.0 - 1e-6)
    if not (lo_r < ratio < hi_r):
        clipped = min(max(ratio, lo_r), hi_r)
        notes.append(f"IoD ratio {ratio:.4g} outside the 2-phase range (1, {t2 / t1:g}); "
                     f"used {clipped:.6g}")
        ratio = clipped
    lo, hi = math.log(1e-9 / t2), math.log(1e6 / t1)
    g = lambda ls: float(_f(math.exp(ls) * t2) / _f(math.exp(ls) * t1)) - ratio  # noqa: E731
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if g(mid) > 0:
            lo = mid
        else:
            hi = mid
    s = math.exp(0.5 * (lo + hi))
    amp = e2 / float(_f(s * t2))
    if ratio != e2 / e1:  # split the clipping error evenly in log space between the two IoDs
        amp = math.sqrt((e1 / float(_f(s * t1))) * (e2 / float(_f(s * t2))))
    # 2) pi1 from the gap CV; l2 >= 0 needs pi1 / pi2 <= 2 m / (amp s).
    q = 2.0 * m / (amp * s)
    pi_max = q / (1.0 + q)
    grid = np.exp(np.linspace(math.log(min(1e-7, 1e-3 * pi_max)),
                              math.log(pi_max * (1 - 1e-9)), 400))
    grid = grid[grid < 1.0 - 1e-9]
    cvs = np.array([_cv2(m, s, amp, p) for p in grid])
    err = np.log(cvs) - math.log(max(cv, 1e-12))
    cross = np.flatnonzero(np.sign(err[:-1]) != np.sign(err[1:]))
    if cross.size:
        # several roots are possible; take the one with the largest pi1 (least extreme rates)
        i = int(cross[-1])
        a, b = math.log(grid[i]), math.log(grid[i + 1])
        fa = err[i]
        for _ in range(100):
            mid = 0.5 * (a + b)
            fm = math.log(_cv2(m, s, amp, math.exp(mid))) - math.log(cv)
            if (fm > 0) == (fa > 0):
                a, fa = mid, fm
            else:
                b = mid
        pi1 = math.exp(0.5 * (a + b))
    else:
        i = int(np.argmin(np.abs(err)))
        pi1 = float(grid[i])
        notes.append(f"gap CV {cv:.4g} not reachable with the fitted IoDs (range "
                     f"{cvs.min():.4g}..{cvs.max():.4g}); used {cvs[i]:.4g}")
    proc64 = _mmpp2(m, s, amp, pi1)
    rates = np.asarray(proc64.rates)
    sw = np.asarray(proc64.switch)
    proc = A.mmpp(rates, sw)
    model = mmpp_stats(proc64, (t1, t2))
    exact = not notes and all(abs(model[k] / tgt[k] - 1.0) < 1e-6 for k in tgt)
    return MMPPFit(arrivals=proc, targets=tgt, model=model, exact=exact, notes=notes,
                   params={"l1": float(rates[0]), "l2": float(rates[1]),
                           "r12": float(sw[0, 1]), "r21": float(sw[1, 0])})


def fit_tokens(trace: Trace, kind: str = "lognormal") -> A.TokenDist:
    """Token-length distribution of a trace: ``"lognormal"`` or ``"empirical"`` (module doc)."""
    tr = validate_trace(trace)
    p = tr.prompt_tokens.astype(np.float64)
    o = tr.output_tokens.astype(np.float64)
    if kind == "empirical":
        return A.empirical_tokens(p, o)
    if kind != "lognormal":
        raise ValueError(f"kind must be 'lognormal' or 'empirical', got {kind!r}")
    lp, lo = np.log(p), np.log(o)
    return A.lognormal_tokens(float(np.exp(lp.mean())), float(lp.std()),
                              float(np.exp(lo.mean())), float(lo.std()),
                              max_prompt=float(p.max()), max_output=float(o.max()))


# ---------------------------------------------------------------------------------------------
# Sampling.
# ---------------------------------------------------------------------------------------------

def _rng(seed_or_key: Any) -> np.random.Generator:
    """A numpy Generator from an int seed, a Generator, or a jax PRNG key."""
    if isinstance(seed_or_key, np.random.Generator):
        return seed_or_key
    if isinstance(seed_or_key, (int, np.integer)):
        return np.random.default_rng(int(seed_or_key))
    key = jnp.asarray(seed_or_key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.default_rng(np.asarray(key, np.uint32).ravel().tolist())


def sample_mmpp(seed_or_key: Any, proc: A.ArrivalProcess, n: int) -> np.ndarray:
    """`n` arrival times (float64 s, first at 0) of an MMPP, exact, in numpy.

    The phase path is simulated sojourn by sojourn (exponential holding times, jumps by the
    switching rates, starting in the phase law at an arrival, `pi * rates / m`); in a
    sojourn of length h in phase j the arrivals are Poisson(rates[j] h) points placed
    uniformly. The first arrival is moved to
    t = 0 (times are rebased like every loaded trace), so the result is the arrival sequence
    after an arbitrary arrival in steady state, in law the same as repeated
    `core.arrivals.sample_gap` calls started in the phase of an arrival.
    """
    rng = _rng(seed_or_key)
    rates, gen = _as_np(proc)
    k = rates.shape[0]
    if n < 1:
        return np.zeros(0)
    pi = _stationary_np(gen)
    m = float(pi @ rates)
    if k == 1:
        gaps = rng.exponential(1.0 / rates[0], n - 1)
        return np.concatenate([[0.0], np.cumsum(gaps)])
    out_rate = -np.diag(gen)
    jump = np.where(out_rate[:, None] > 0, (gen - np.diag(np.diag(gen)))
                    / np.maximum(out_rate[:, None], 1e-300), 0.0)
    cum = np.cumsum(jump, axis=1)
    # start in the phase law seen by an arrival, phi = pi * rates / m
    phase = int(rng.choice(k, p=pi * rates / m))
    chunks, total, t = [np.zeros(1)], 1, 0.0
    need = n  # the first arrival at 0, then n - 1 more
    while total < need:
        # simulate a batch of sojourns
        # enough sojourns for the arrivals still needed (about m / mean switching rate each)
        per = m / max(float(pi @ out_rate), 1e-300)
        batch = int(min(4096, max(16, 1.25 * (need - total) / max(per, 1e-9) + 16)))
        if k == 2 and np.all(out_rate > 0):  # two phases alternate
            phs = (phase + np.arange(batch)) % 2
            phase = int((phase + batch) % 2)
        else:
            phs = np.empty(batch, np.int64)
            u = rng.random(batch)
            for i in range(batch):
                phs[i] = phase
                if out_rate[phase] > 0:
                    nxt = int(np.searchsorted(cum[phase], u[i] * cum[phase, -1], side="right"))
                    phase = min(nxt, k - 1)
        hold = np.where(out_rate[phs] > 0, rng.exponential(1.0, batch)
                        / np.maximum(out_rate[phs], 1e-300), np.inf)
        cnt = rng.poisson(np.where(np.isfinite(hold), rates[phs] * hold, 0.0))
        inf = ~np.isfinite(hold)
        if inf.any():  # absorbing phase: the rest is Poisson at that phase's rate
            j = int(np.flatnonzero(inf)[0])
            starts = t + np.concatenate([[0.0], np.cumsum(hold[:j])])
            for jj in range(j):
                chunks.append(np.sort(starts[jj] + hold[jj] * rng.random(cnt[jj])))
                total += cnt[jj]
            gaps = rng.exponential(1.0 / rates[phs[j]], max(need - total, 0))
            chunks.append(starts[j] + np.cumsum(gaps))
            total += gaps.shape[0]
            break
        starts = t + np.concatenate([[0.0], np.cumsum(hold[:-1])])
        pts = np.repeat(starts, cnt) + np.repeat(hold, cnt) * rng.random(int(cnt.sum()))
        chunks.append(np.sort(pts))  # sojourns are disjoint and in order
        total += int(cnt.sum())
        t = float(starts[-1] + hold[-1])
    arr = np.concatenate(chunks)[:n]
    return arr


def sample_arrivals_jax(key: jax.Array, proc: A.ArrivalProcess, n: int,
                        chunk: int = 16384) -> np.ndarray:
    """`n` arrival times (float64 s, first at 0) drawn with the engine's own
    `core.arrivals.sample_gap` under `jax.lax.scan` (float32 gaps, accumulated in float64).

    The first phase is drawn from the stationary law (as `env.reset` does); scans run in chunks
    of `chunk` gaps so one compiled program serves any `n`.
    """
    k0, key = jax.random.split(key)
    phase = A.sample_phase(k0, proc)
    gaps = []
    left = max(n - 1, 0)
    while left > 0:
        key, kc = jax.random.split(key)
        g, phase = _scan_gaps(kc, phase, proc, chunk)
        gaps.append(np.asarray(g, np.float64)[:left])
        left -= gaps[-1].shape[0]
    return np.concatenate([[0.0], np.cumsum(np.concatenate(gaps))]) if gaps else np.zeros(n)


@jax.jit
def _scan_gaps_impl(key, phase, proc, dummy):
    def step(ph, k):
        g, ph = A.sample_gap(k, ph, proc)
        return ph, g

    phase, g = jax.lax.scan(step, phase, jax.random.split(key, dummy.shape[0]))
    return g, phase


def _scan_gaps(key, phase, proc, chunk):
    return _scan_gaps_impl(key, phase, proc, jnp.zeros((chunk,), jnp.int8))


def sample_tokens_np(seed_or_key: Any, tokens: A.TokenDist,
                     n: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` (prompt, output) token lengths in numpy, the same law as `core.arrivals.sample_tokens`
    (class mixture of rounded, clipped lognormals, or uniform rows of an empirical table)."""
    rng = _rng(seed_or_key)
    tp = np.asarray(tokens.table_prompt, np.float64)
    if tp.shape[-1] > 0:
        i = rng.integers(0, tp.shape[-1], n)
        to = np.asarray(tokens.table_output, np.float64)
        return tp[i].astype(np.int64), to[i].astype(np.int64)
    w = np.asarray(tokens.weights, np.float64)
    c = rng.choice(w.shape[0], size=n, p=w / w.sum())
    pm = np.asarray(tokens.prompt_median, np.float64)
    ps = np.asarray(tokens.prompt_sigma, np.float64)
    om = np.asarray(tokens.output_median, np.float64)
    os_ = np.asarray(tokens.output_sigma, np.float64)
    # float32 like the engine, so rounding at the medians agrees
    p = np.round(np.float32(pm[c] * np.exp(ps[c] * rng.standard_normal(n))))
    o = np.round(np.float32(om[c] * np.exp(os_[c] * rng.standard_normal(n))))
    p = np.clip(p, 1, float(tokens.max_prompt))
    o = np.clip(o, 1, float(tokens.max_output))
    return p.astype(np.int64), o.astype(np.int64)


def sample_workload(seed_or_key: Any, arrivals: A.ArrivalProcess, tokens: A.TokenDist,
                    n: int) -> Trace:
    """A synthetic `Trace` of `n` requests: MMPP arrivals (`sample_mmpp`) and token lengths
    (`sample_tokens_np`), first arrival at 0."""
    rng = _rng(seed_or_key)
    arr = sample_mmpp(rng, arrivals, n)
    p, o = sample_tokens_np(rng, tokens, n)
    return Trace(arrival_s=arr, prompt_tokens=p, output_tokens=o)


# ---------------------------------------------------------------------------------------------
# Workload fit and report.
# ---------------------------------------------------------------------------------------------

REPORT_KEYS = ("mean_rate", "cv_interarrival", "iod_1s", "iod_60s",
               "prompt_mean", "prompt_p50", "prompt_p90", "prompt_p99",
               "output_mean", "output_p50", "output_p90", "output_p99")


@dataclasses.dataclass
class WorkloadFit:
    """A synthetic workload fitted to a trace, and how close it is.

    Attributes:
      arrivals: fitted `ArrivalProcess` (2-phase MMPP).
      tokens: fitted `TokenDist`.
      mmpp: the `MMPPFit` (targets, analytic model statistics, parameters, notes).
      report: `fit_report`'s dict: for each statistic in `REPORT_KEYS`, `trace`, `model`
        (analytic; arrivals only), `sample` (mean over the sampled traces), `sample_sd`
        (their spread) and `rel_err` (`sample / trace - 1`).
    """

    arrivals: A.ArrivalProcess
    tokens: A.TokenDist
    mmpp: MMPPFit
    report: dict


def fit_report(trace: Trace, arrivals: A.ArrivalProcess, tokens: A.TokenDist, *,
               seed: Any = 0, n_samples: int | None = None, reps: int = 5) -> dict:
    """How close a synthetic workload is to a trace.

    `reps` synthetic traces of `n_samples` requests (default: 4 x the trace's length, at least
    20,000) are drawn with `sample_workload` and summarised like the trace (`summary`, with
    IoDs over complete 1 s and 60 s windows, `count_iod`); each statistic of `REPORT_KEYS`
    is reported for the trace, the model (analytic arrival statistics), the mean and standard
    deviation over the samples, and the relative error of the sample mean against the trace.
    """
    tr = validate_trace(trace)
    n = int(n_samples) if n_samples else max(4 * len(tr), 20000)
    st = _stats(tr)
    rng = _rng(seed)
    samples = [_stats(sample_workload(rng, arrivals, tokens, n)) for _ in range(reps)]
    model = mmpp_stats(arrivals, (1.0, 60.0))
    out = {}
    for k in REPORT_KEYS:
        vals = np.array([s[k] for s in samples])
        out[k] = {"trace": float(st[k]), "model": float(model[k]) if k in model else float("nan"),
                  "sample": float(vals.mean()), "sample_sd": float(vals.std()),
                  "rel_err": float(vals.mean() / st[k] - 1.0) if st[k] else float("nan")}
    out["_meta"] = {"n_samples": n, "reps": reps, "trace_rows": len(tr)}
    return out


def fit_workload(trace: Trace, *, tokens: str = "lognormal",
                 scales: Sequence[float] = (1.0, 60.0), seed: Any = 0,
                 n_samples: int | None = None, reps: int = 5) -> WorkloadFit:
    """Fits MMPP arrivals (`fit_mmpp`) and token lengths (`fit_tokens`) and reports the fit.

    The result's `arrivals` and `tokens` go straight into
    `jaxserve.make("Routing-v0", arrivals=fit.arrivals, tokens=fit.tokens)`.
    """
    mf = fit_mmpp(trace, scales)
    tok = fit_tokens(trace, tokens)
    rep = fit_report(trace, mf.arrivals, tok, seed=seed, n_samples=n_samples, reps=reps)
    return WorkloadFit(arrivals=mf.arrivals, tokens=tok, mmpp=mf, report=rep)


def _fmt(x: float) -> str:
    if not np.isfinite(x):
        return "n/a"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def fit_table(named: Sequence[tuple[str, dict]], keys: Sequence[str] = REPORT_KEYS) -> str:
    """A markdown table of `fit_report` dicts: `trace / sample (rel. err.)` per statistic."""
    head = "| trace | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys) + "\n"
    rows = []
    for name, rep in named:
        cells = []
        for k in keys:
            r = rep[k]
            cells.append(f"{_fmt(r['trace'])} / {_fmt(r['sample'])} ({100 * r['rel_err']:+.1f}%)")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return head + "\n".join(rows) + "\n"
