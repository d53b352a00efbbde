"""Prints the fit of jaxserve's batch service-time model to published LLM-serving measurements.

The fit itself is `jaxserve.core.profile_fit` (source rows, method and checks are described
there and in docs/profiles.md). Run from the repository root:

    python -m jaxserve.scripts.fit_profiles            # table of coefficients and fit quality
    python -m jaxserve.scripts.fit_profiles --python   # also the PROFILES entries for profiles.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from jaxserve.core.profile_fit import (DATA_CSV, FIT_MAX_BATCH, SOURCE, ProfileFit, fit_all,
                                       service_time)


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
