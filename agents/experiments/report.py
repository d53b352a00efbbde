"""docs/results.md from the experiments' sections: provenance header, one part per
experiment (its tables, figures and wall time), and a JSON of the numbers."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from agents.experiments.common import Context, Section

INTRO = """\
Every number on this page is written by `scripts/reproduce.py` (the command in each table's
caption); nothing is typed in by hand. Edit the experiments (`agents/experiments/`), not this
file. Methodology: docs/baselines.md ("Evaluation methodology"). In short: common random
numbers (every policy of a table sees the same request streams), exact per-request
latencies, the **drop-inclusive mean latency** as the headline metric (a dropped request
counts at the environment's drop penalty, 600 s, so shedding load never looks fast), learned
policies trained with several seeds (the seed is the replicate of their CIs), comparisons as
**paired** differences on the common streams, and every tuned or fitted baseline (SITA,
tuned_static, smdp_optimal) fitted on tuning streams that evaluation refuses
(`core.sources.tuning_key`). Results are reported whichever way they fall.
"""

STUDY_NOTE = """\
**Where ours differ from the study's, and why.** The study reported its RL router at about
3.5x round robin's throughput, 48% above JSQ, with about 25% lower latency, and, on one GPU,
static batching near-optimal (RL gains 0.1-1.0%). Its exact reward formula and service
model are not among this project's sources, so (a) reproduces its *setting* (identical GPUs,
fast/slow classes, greedy batches, weak baselines) on our calibrated service model, and
reports our environments' own objective next to throughput and latency. In an open system
below saturation every policy that drops nothing has the same throughput (the arrival
rate): throughput ratios far from 1 can only come from overload, where the weak baselines
drop requests. Latency is where routing shows, and it shows most when request sizes differ
(head-of-line blocking in static batches).
"""


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def write_results(sections: Sequence[Section], ctx: Context, md_path, fig_dir,
                  wall_s: float) -> Path:
    """Writes `md_path` (markdown), its figures under `fig_dir` and `md_path`.json (data)."""
    md_path, fig_dir = Path(md_path), Path(fig_dir)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    fig_dir.mkdir(parents=True, exist_ok=True)
    b = ctx.budget
    cpu = platform.processor() or platform.machine()
    lines = ["# Results", "", INTRO,
             f"This run: `{ctx.command}` (budget `{b.name}`: seeds {list(b.seeds)}, "
             f"{b.routing_steps} routing / {b.batching_steps} batching training steps per run)"
             f", at commit `{_git_commit()}` (plus uncommitted changes, if any), on "
             f"{jax.default_backend()} ({jax.device_count()} device(s), {cpu}); wall time "
             f"**{wall_s / 60:.1f} min** in all. On a shared CPU the wall times are noisy.",
             "", STUDY_NOTE]
    for sec in sections:
        lines += ["", f"## {sec.title}", "", f"*Wall time of this experiment: "
                  f"{sec.wall_s:.0f} s.*", "", sec.body]
        for name, draw in sec.figures.items():
            draw(fig_dir / name)
            rel = Path(*(fig_dir.resolve().relative_to(md_path.parent.resolve()).parts),
                       name) if fig_dir.resolve().is_relative_to(md_path.parent.resolve()) \
                else fig_dir / name
            lines += ["", f"![{sec.title}]({rel.as_posix()})"]
    md_path.write_text("\n".join(lines) + "\n")
    data = {s.key: _jsonable(s.data) for s in sections}
    md_path.with_suffix(".json").write_text(json.dumps(data, indent=1, allow_nan=False))
    return md_path
