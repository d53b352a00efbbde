"""Fits jaxserve's batch service-time model to published LLM-serving latency measurements.

Source rows: `jaxserve/core/profile_data/splitwise_perf_model_subset.csv`, a verbatim subset of
`data/perf_model.csv` from Mutinifni/splitwise-sim (MIT; see the CSV header and
`docs/profiles.md`). Each row is one measured run of a (model, hardware, tensor_parallel)
replica: `prompt_time` (ms) to prefill `batch_size` prompts of `prompt_size` tokens, and
`token_time` (ms) of one decode iteration of that batch.

For every replica configuration the two halves of the closed form of `docs/contract_static.md` are fit
by non-negative least squares (all coefficients >= 0, as the model requires) on the rows with
`batch_size <= FIT_MAX_BATCH`:

    prefill(S)   = c0   + alpha * sum p + alpha2 * sum p^2       (p = prompt_size, |S| = batch_size)
    decode_it(S) = beta + gamma * |S|   + delta  * sum p

so that a static batch runs for `T(S) = prefill(S) + max o * decode_it(S)`.

The command line is `python -m jaxserve.scripts.fit_profiles [--python]` (scripts/fit_profiles.py);
tests/test_profiles.py checks that `jaxserve.core.profiles` holds what this fit computes.
"""

from __future__ import annotations

import csv
import itertools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from jaxserve.core.service import service_time as _closed_form

DATA_CSV = Path(__file__).resolve().parent / "profile_data" / "splitwise_perf_model_subset.csv"
SOURCE = ("Mutinifni/splitwise-sim", "data/perf_model.csv",
          "378088013a54df6f2052c27ff5ae6ea7619c3ecc")

# Rows with larger batches are kept in the CSV but not fitted: the profiles cap batches at 16,
# decode time grows faster than linearly past 32 sequences, and the tensor_parallel=2 rows at
# batch 64 are inconsistent with the rest of the sweep (prefill of 64 prompts reported faster
# than of 2), which suggests those runs did not execute the full batch.
FIT_MAX_BATCH = 32

# (model, hardware, tensor_parallel) -> profile name. Hardware names are the source's.
CONFIGS: dict[tuple[str, str, int], str] = {
    ("llama2-70b", "h100-80gb", 2): "h100-llama2-70b-tp2",
    ("llama2-70b", "h100-80gb", 4): "h100-llama2-70b-tp4",
    ("llama2-70b", "h100-80gb", 8): "h100-llama2-70b-tp8",
    ("llama2-70b", "a100-80gb", 2): "a100-llama2-70b-tp2",
    ("llama2-70b", "a100-80gb", 4): "a100-llama2-70b-tp4",
    ("llama2-70b", "a100-80gb", 8): "a100-llama2-70b-tp8",
    ("bloom-176b", "h100-80gb", 8): "h100-bloom-176b-tp8",
    ("bloom-176b", "a100-80gb", 8): "a100-bloom-176b-tp8",
}


@dataclass(frozen=True)
class PhaseFit:
    """Non-negative least-squares fit of one phase (prefill or decode iteration)."""

    coef: tuple[float, float, float]  # seconds-based coefficients, in design-column order
    r2: float  # over the fitted rows
    max_rel_err: float  # max |fit - row| / row over the fitted rows
    max_rel_err_median: float  # same, against the median of the repeats of each point
    max_abs_err: float  # max |fit - row| over the fitted rows (s)
    n_rows: int


@dataclass(frozen=True)
class ProfileFit:
    name: str
    model: str
    hardware: str
    tensor_parallel: int
    prefill: PhaseFit  # coef = (c0, alpha, alpha2)
    decode: PhaseFit  # coef = (beta, gamma, delta)
    # Whole-batch check on the fitted rows: T(S) of the closed form with every o = token_size
    # against the measured prompt_time + token_size * token_time of the same row.
    service_max_rel_err: float
    service_mean_rel_err: float

    def coefficients(self) -> dict[str, float]:
        c0, alpha, alpha2 = self.prefill.coef
        beta, gamma, delta = self.decode.coef
        return dict(c0=c0, alpha=alpha, alpha2=alpha2, beta=beta, gamma=gamma, delta=delta)


def load_rows(path: Path = DATA_CSV) -> dict[str, np.ndarray]:
    """Reads the source CSV (lines starting with '#' are comments) into column arrays."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if not ln.lstrip().startswith("#") and ln.strip()]
    rows = list(csv.DictReader(lines))
    if not rows:
        raise ValueError(f"no data rows in {path}")
    out: dict[str, np.ndarray] = {
        "model": np.array([r["model"] for r in rows]),
        "hardware": np.array([r["hardware"] for r in rows]),
    }
    for k in ("tensor_parallel", "prompt_size", "batch_size", "token_size"):
        out[k] = np.array([int(r[k]) for r in rows], dtype=np.int64)
    for k in ("prompt_time", "token_time"):
        out[k] = np.array([float(r[k]) for r in rows], dtype=np.float64)
    return out


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a few columns: min ||x c - y||, c >= 0.

    The optimum is the unconstrained least-squares solution on its own support, so it is the
    best feasible solution among all column subsets (2^k of them; k = 3 here).
    """
    k = x.shape[1]
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best, best_rss = np.zeros(k), float(y @ y)
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sub, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if np.any(sub < 0):
                continue
            c = np.zeros(k)
            c[list(cols)] = sub
            rss = float(np.sum((xs @ c - y) ** 2))
            if rss < best_rss:
                best, best_rss = c, rss
    return best / scale


def _fit_phase(x: np.ndarray, y: np.ndarray, keys: np.ndarray) -> PhaseFit:
    coef = nnls(x, y)
    pred = x @ coef
    r2 = 1.0 - float(np.sum((y - pred) ** 2)) / float(np.sum((y - y.mean()) ** 2))
    rel = float(np.max(np.abs(pred - y) / y))
    rel_med = 0.0
    for key in np.unique(keys):
        m = keys == key
        med = float(np.median(y[m]))
        rel_med = max(rel_med, abs(float(pred[m][0]) - med) / med)
    return PhaseFit(coef=tuple(float(c) for c in coef), r2=r2, max_rel_err=rel,
                    max_rel_err_median=rel_med, max_abs_err=float(np.max(np.abs(pred - y))),
                    n_rows=int(y.size))


def fit_config(rows: dict[str, np.ndarray], model: str, hardware: str, tp: int,
               name: str, max_batch: int = FIT_MAX_BATCH) -> ProfileFit:
    m = ((rows["model"] == model) & (rows["hardware"] == hardware)
         & (rows["tensor_parallel"] == tp) & (rows["batch_size"] <= max_batch))
    if not np.any(m):
        raise ValueError(f"no rows for {model} on {hardware} with tensor_parallel={tp}")
    p = rows["prompt_size"][m].astype(np.float64)
    b = rows["batch_size"][m].astype(np.float64)
    keys = rows["prompt_size"][m] * 100_000 + rows["batch_size"][m]  # one key per sweep point
    o = rows["token_size"][m].astype(np.float64)
    ones = np.ones_like(p)
    x_pre = np.stack([ones, b * p, b * p * p], axis=1)
    x_dec = np.stack([ones, b, b * p], axis=1)
    y_pre = rows["prompt_time"][m] / 1000.0
    y_dec = rows["token_time"][m] / 1000.0
    prefill = _fit_phase(x_pre, y_pre, keys)
    decode = _fit_phase(x_dec, y_dec, keys)
    t_fit = x_pre @ np.array(prefill.coef) + o * (x_dec @ np.array(decode.coef))
    t_obs = y_pre + o * y_dec
    t_rel = np.abs(t_fit - t_obs) / t_obs
    return ProfileFit(name=name, model=model, hardware=hardware, tensor_parallel=tp,
                      prefill=prefill, decode=decode,
                      service_max_rel_err=float(t_rel.max()),
                      service_mean_rel_err=float(t_rel.mean()))


def fit_all(path: Path = DATA_CSV) -> dict[str, ProfileFit]:
    """Fits every configuration in CONFIGS; returns {profile name: ProfileFit}."""
    rows = load_rows(path)
    return {name: fit_config(rows, model, hw, tp, name)
            for (model, hw, tp), name in CONFIGS.items()}


def service_time(coef: dict[str, float], p: np.ndarray, o: np.ndarray) -> float:
    """T(S) of docs/contract_static.md (`core.service.service_time`) for one batch with prompt lengths
    `p` and output lengths `o`, from a `coefficients()` dict (seconds)."""
    p = np.asarray(p, dtype=np.float64)
    o = np.asarray(o, dtype=np.float64)
    return float(_closed_form(SimpleNamespace(**coef), p.size, p.sum(), (p * p).sum(), o.max()))
