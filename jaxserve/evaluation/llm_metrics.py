"""Per-request LLM serving metrics from an LLMRouting-v0 replay (`jaxserve.replay`).

MODEL_CONTINUOUS.md: `ttft = first_token - arrival`, `e2e = finish - arrival`,
`tpot = (finish - first_token) / (o - 1)` for `o > 1` output tokens (undefined, NaN, for
`o = 1`). SLO attainment (DistServe): a request meets its SLO when `ttft <= slo_ttft` and
`tpot <= slo_tpot` (a one-token request: `ttft` alone); dropped requests miss it. Goodput is the
rate of requests that meet it, over the span from the first arrival to the last finish.
Host-side numpy; not for use under jit.
"""

from __future__ import annotations

import numpy as np


def request_metrics(result: dict, output_tokens) -> dict:
    """`ttft`, `tpot` and `e2e` (s) per request; NaN where dropped (and `tpot` where `o = 1`)."""
    o = np.asarray(output_tokens, np.float64)
    if o.shape != result["arrival"].shape:
        raise ValueError(f"output_tokens has shape {o.shape}, the replay {result['arrival'].shape}")
    ttft = result["first_token"] - result["arrival"]
    e2e = result["finish"] - result["arrival"]
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(o > 1, (result["finish"] - result["first_token"]) / (o - 1), np.nan)
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e}


def slo_attainment(result: dict, output_tokens, slo_ttft: float, slo_tpot: float) -> dict:
    """SLO attainment and goodput of a replay.

    Returns:
      dict: `met` (bool per request), `attainment` (fraction of all requests, drops included),
      `goodput` (requests meeting the SLO per second of the replay's span), `span_s`.
    """
    m = request_metrics(result, output_tokens)
    ok = ~np.asarray(result["dropped"], bool)
    tpot_ok = np.where(np.isnan(m["tpot"]), True, m["tpot"] <= slo_tpot)
    met = ok & (m["ttft"] <= slo_ttft) & tpot_ok
    finish = result["finish"][ok]
    span = (finish.max() if finish.size else result["arrival"].max()) - result["arrival"].min()
    return {"met": met, "attainment": float(met.mean()) if met.size else float("nan"),
            "goodput": float(met.sum() / span) if span > 0 else float("nan"),
            "span_s": float(span)}
