"""Fits jaxserve's batch service-time model to published LLM-serving latency measurements.

Source rows: `jaxserve/core/profile_data/splitwise_perf_model_subset.csv`, a verbatim subset of
`data/perf_model.csv` from Mutinifni/splitwise-sim (MIT; see the CSV header and
`docs/profiles.md`). Each row is one measured run of a (model, hardware, tensor_parallel)
replica: `prompt_time` (ms) to prefill `batch_size` prompts of `prompt_size` tokens, and
`token_time` (ms) of one decode iteration of that batch.

For every replica configuration the two halves of the closed form of `shared/MODEL.md` are fit
by non-negative least squares (all coefficients >= 0, as the model requires) on the rows with
`batch_size <= FIT_MAX_BATCH`:

    prefill(S)   = c0   + alpha * sum p + alpha2 * sum p^2       (p = prompt_size, |S| = batch_size)
    decode_it(S) = beta + gamma * |S|   + delta  * sum p

so that a static batch runs for `T(S) = prefill(S) + max o * decode_it(S)`.

Run from the repository root:

    python -m scripts.fit_profiles            # table of coefficients and fit quality
    python -m scripts.fit_profiles --python   # also the PROFILES entries for profiles.py

Only numpy is needed.
"""

from __future__ import annotations

import argparse
import csv
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA_CSV = (Path(__file__).resolve().parent.parent / "jaxserve" / "core" / "profile_data"
            / "splitwise_perf_model_subset.csv")
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
    """T(S) of shared/MODEL.md for one batch with prompt lengths p and output lengths o."""
    p = np.asarray(p, dtype=np.float64)
    o = np.asarray(o, dtype=np.float64)
    return float(coef["c0"] + coef["alpha"] * p.sum() + coef["alpha2"] * (p * p).sum()
                 + o.max() * (coef["beta"] + coef["gamma"] * p.size + coef["delta"] * p.sum()))


def _format_table(fits: dict[str, ProfileFit]) -> str:
    hdr = (f"{'profile':<22}{'c0 [s]':>12}{'alpha [s/tok]':>15}{'alpha2 [s/tok^2]':>18}"
           f"{'beta [s]':>12}{'gamma [s]':>12}{'delta [s/tok]':>15}")
    lines = [hdr, "-" * len(hdr)]
    for f in fits.values():
        c = f.coefficients()
        lines.append(f"{f.name:<22}{c['c0']:>12.4e}{c['alpha']:>15.4e}{c['alpha2']:>18.4e}"
                     f"{c['beta']:>12.4e}{c['gamma']:>12.4e}{c['delta']:>15.4e}")
    lines += ["", f"{'profile':<22}{'phase':<9}{'rows':>5}{'R^2':>9}{'max rel err':>13}"
              f"{'vs median':>11}{'max abs err [ms]':>18}"]
    for f in fits.values():
        for ph_name, ph in (("prefill", f.prefill), ("decode", f.decode)):
            lines.append(f"{f.name:<22}{ph_name:<9}{ph.n_rows:>5}{ph.r2:>9.4f}"
                         f"{ph.max_rel_err:>13.3f}{ph.max_rel_err_median:>11.3f}"
                         f"{1000 * ph.max_abs_err:>18.1f}")
    lines += ["", f"{'profile':<22}{'service T: max rel err':>24}{'mean rel err':>14}"
              f"{'T(8 x p=512, o=128) [s]':>26}"]
    p8, o8 = np.full(8, 512), np.full(8, 128)
    for f in fits.values():
        t = service_time(f.coefficients(), p8, o8)
        lines.append(f"{f.name:<22}{f.service_max_rel_err:>24.3f}{f.service_mean_rel_err:>14.3f}"
                     f"{t:>26.3f}")
    return "\n".join(lines)


def _format_python(fits: dict[str, ProfileFit]) -> str:
    out = []
    for f in fits.values():
        c = f.coefficients()
        out.append(f"    # {f.model} on {f.hardware}, tensor_parallel={f.tensor_parallel}: "
                   f"prefill R^2={f.prefill.r2:.4f}, max rel err {f.prefill.max_rel_err:.3f} "
                   f"({f.prefill.max_rel_err_median:.3f} vs medians); decode R^2="
                   f"{f.decode.r2:.4f}, max rel err {f.decode.max_rel_err:.3f} "
                   f"({f.decode.max_rel_err_median:.3f} vs medians); service time max rel err "
                   f"{f.service_max_rel_err:.3f}.")
        out.append(f'    "{f.name}": _profile(')
        out.append(f'        "{f.name}",')
        for keys, end in ((("c0", "alpha", "alpha2"), ","), (("beta", "gamma", "delta"), "),")):
            out.append("        " + ", ".join(f"{k}={c[k]!r}" for k in keys) + end)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", type=Path, default=DATA_CSV, help="source rows (default: %(default)s)")
    ap.add_argument("--python", action="store_true", help="also print PROFILES entries")
    args = ap.parse_args(argv)
    fits = fit_all(args.csv)
    print(f"source: {SOURCE[0]} {SOURCE[1]} @ {SOURCE[2]}")
    print(f"fit: non-negative least squares on rows with batch_size <= {FIT_MAX_BATCH}, "
          "times in seconds\n")
    print(_format_table(fits))
    if args.python:
        print()
        print(_format_python(fits))


if __name__ == "__main__":
    main()
