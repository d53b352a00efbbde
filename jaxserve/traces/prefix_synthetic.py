"""Synthetic shared-prefix workload: system prompts x multi-turn sessions (numpy, host side).

A session starts at a Poisson instant (rate `session_rate`), picks one of `num_system` system
prompts with Zipf popularity (`P(k) ~ (k + 1)^-system_zipf`), and runs `1 + Geometric` turns
(mean `turns_mean`); turn `k + 1` arrives an exponential think time (mean `think_s`) after turn
`k`. Turn `k`'s prompt is the conversation so far, as a chat server sends it:

    prompt_k = system + user_1 + output_1 + ... + user_{k-1} + output_{k-1} + user_k

with user inputs lognormal (first turn: median `first_user_median`, log-sd `first_user_sigma`;
later turns: `next_user_*`) and outputs lognormal (`output_median`, `output_sigma`), rounded and
at least 1 token. Prompts are cut into `block_tokens`-token hash blocks as Mooncake's are: a
block is identified by its content, so full blocks inside the system prompt are shared by every
session using it, full blocks of a session's conversation are shared by its later turns (the
conversation only grows), and the partial last block of a prompt is its own. The result is a
`PrefixTrace` (the same static-shape prefix tree the Mooncake loader returns).

The defaults are hand-set to resemble Mooncake's conversation trace (one 512-token system
prompt; 61% first turns; first-turn prompts of median ~5k tokens; short follow-ups); docs/
prefix_caching.md compares the statistics. They are not a likelihood fit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.types import Trace, validate_trace
from jaxserve.traces.prefix import PrefixTrace, build_prefix_tree, reused_blocks

__all__ = ["SharedPrefixConfig", "draw_sessions", "generate_shared_prefix", "prefix_stats"]


@dataclasses.dataclass(frozen=True)
class SharedPrefixConfig:
    """Parameters of the shared-prefix generator (times in s, lengths in tokens)."""

    session_rate: float = 2.15
    num_system: int = 1
    system_tokens: int = 512
    system_zipf: float = 1.0
    turns_mean: float = 1.66
    think_s: float = 120.0
    first_user_median: float = 5500.0
    first_user_sigma: float = 1.4
    next_user_median: float = 250.0
    next_user_sigma: float = 1.5
    output_median: float = 350.0
    output_sigma: float = 0.45
    max_prompt: int = 131072
    block_tokens: int = 512

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        positive = ("session_rate", "think_s", "first_user_median", "next_user_median",
                    "output_median")
        for f in positive:
            v = getattr(self, f)
            if not np.isfinite(v) or v <= 0:
                raise ValueError(f"SharedPrefixConfig.{f} must be finite and > 0, got {v}")
        for f in ("first_user_sigma", "next_user_sigma", "output_sigma", "system_zipf"):
            v = getattr(self, f)
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"SharedPrefixConfig.{f} must be finite and >= 0, got {v}")
        if not np.isfinite(self.turns_mean) or self.turns_mean < 1:
            raise ValueError(f"SharedPrefixConfig.turns_mean must be >= 1, got "
                             f"{self.turns_mean}")
        for f, lo in (("num_system", 1), ("system_tokens", 0), ("block_tokens", 1),
                      ("max_prompt", 1)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"SharedPrefixConfig.{f} must be an integer >= {lo}, got {v}")
        if self.system_tokens >= self.max_prompt:
            raise ValueError("SharedPrefixConfig.system_tokens must be < max_prompt")


def _lognormal(rng, median, sigma, size):
    return np.maximum(1, np.rint(median * np.exp(sigma * rng.standard_normal(size)))).astype(
        np.int64)


def draw_sessions(n_requests: int, config: SharedPrefixConfig | None = None,
                  seed: int = 0) -> list[tuple[float, int, int, int, int, int]]:
    """The earliest `n_requests` turns of the session model, in arrival order, as rows
    `(arrival_s, session, turn, prompt, output, system)` (arrivals not rebased).

    Prompts are capped at `max_prompt` tokens (a session whose conversation outgrows it ends
    there). Deterministic in `seed`. Raises ValueError for `n_requests < 1` or an invalid config
    (naming the field)."""
    cfg = config or SharedPrefixConfig()
    cfg.validate()
    if isinstance(n_requests, bool) or not isinstance(n_requests, (int, np.integer)) \
            or n_requests < 1:
        raise ValueError(f"n_requests must be an integer >= 1, got {n_requests}")
    rng = np.random.default_rng(seed)
    pop = (np.arange(1, cfg.num_system + 1, dtype=np.float64)) ** -cfg.system_zipf
    pop /= pop.sum()
    p_end = 1.0 / cfg.turns_mean  # geometric: P(turns = t) = (1 - p)^(t - 1) p
    rows = []
    # Once n rows exist, a session starting after the n-th earliest arrival cannot contribute
    # (its turns all come later), so drawing stops there: the n earliest rows are exact.
    t0 = 0.0
    session = 0
    horizon = np.inf
    while True:
        t0 += rng.exponential(1.0 / cfg.session_rate)
        if t0 > horizon:
            break
        sys_k = int(rng.choice(cfg.num_system, p=pop))
        turns = int(rng.geometric(p_end))
        t = t0
        history = cfg.system_tokens
        for k in range(turns):
            if k:
                t += rng.exponential(cfg.think_s)
            first = k == 0
            user = int(_lognormal(rng, cfg.first_user_median if first else cfg.next_user_median,
                                  cfg.first_user_sigma if first else cfg.next_user_sigma, 1)[0])
            out = int(_lognormal(rng, cfg.output_median, cfg.output_sigma, 1)[0])
            prompt = history + user
            if prompt > cfg.max_prompt:
                break
            rows.append((t, session, k, prompt, out, sys_k))
            history = prompt + out
        session += 1
        if len(rows) >= n_requests:
            horizon = np.partition(np.array([r[0] for r in rows]), n_requests - 1)[
                n_requests - 1]
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    return rows[:n_requests]


def generate_shared_prefix(n_requests: int, config: SharedPrefixConfig | None = None,
                           seed: int = 0) -> PrefixTrace:
    """Draws `n_requests` requests of the session model (`draw_sessions`) as a `PrefixTrace`
    with arrivals rebased so that the first request is at 0 s."""
    cfg = config or SharedPrefixConfig()
    rows = draw_sessions(n_requests, cfg, seed)
    T = cfg.block_tokens
    lists = []
    for idx, (_, s, _, prompt, _, sys_k) in enumerate(rows):
        # a full block wholly inside the system prompt is the system's, a later one the
        # session's (the conversation only grows); the partial last block is the request's own
        ids = [("sys", sys_k, q) if (q + 1) * T <= cfg.system_tokens else ("s", s, q)
               for q in range(prompt // T)]
        if prompt % T:
            ids.append(("r", idx))
        lists.append(ids)
    intern: dict = {}
    tree, node = build_prefix_tree(
        [[intern.setdefault(h, len(intern)) for h in ids] for ids in lists], T)
    arrival = np.array([r[0] for r in rows], np.float64)
    prompt = np.array([r[3] for r in rows], np.int64)
    trace = validate_trace(Trace(arrival_s=arrival - arrival[0], prompt_tokens=prompt,
                                 output_tokens=np.array([r[4] for r in rows], np.int64)))
    return PrefixTrace(trace=trace, node=node, full_blocks=prompt // T, tree=tree)


def prefix_stats(pt: PrefixTrace) -> dict:
    """Summary of a prefix trace, the quantities of the traces README's Mooncake table: number
    of requests, mean rate (req/s, (n-1)/span), CV of inter-arrival gaps, prompt and output
    p50/p90/p99 (numpy linear interpolation), infinite-cache block reuse, and the share of
    requests reusing at most one block ("first turns" under one 1-block system prompt)."""
    tr = pt.trace
    a = np.asarray(tr.arrival_s, np.float64)
    gaps = np.diff(a)
    reused = reused_blocks(pt)
    depth = np.where(pt.node >= 0, pt.tree.depth[np.maximum(pt.node, 0)], 0)
    return {
        "requests": len(pt),
        "rate": (len(a) - 1) / (a[-1] - a[0]) if len(a) > 1 and a[-1] > a[0] else float("nan"),
        "cv": float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else float("nan"),
        "prompt_pct": np.percentile(tr.prompt_tokens, [50, 90, 99]).tolist(),
        "output_pct": np.percentile(tr.output_tokens, [50, 90, 99]).tolist(),
        "reuse": float(reused.sum() / depth.sum()) if depth.sum() else 0.0,
        "reuse_le1": float(np.mean(reused <= 1)),
    }
