"""docs/results.md from the experiments' sections: provenance header, one part per
experiment (its provenance, tables, figures and wall time), and a JSON of the numbers.

A run of some experiments (`reproduce.py --only b`) merges into the existing page: the other
sections keep their text and the command and commit that wrote them."""

from __future__ import annotations

import json
import platform
import re
import subprocess
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from jaxserve.agents.experiments.common import Context, Section

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

# Results that scripts/reproduce.py does not write, listed so that this page indexes them all.
OTHER_PAGES = """\
**Other results pages.** Results that `scripts/reproduce.py` does not write live beside their
environments:
- [docs/continuous.md](continuous.md): LLM routing and autoscaling (LLMRouting-v0,
  LLMAutoscaling-v0).
- [docs/scaling.md](scaling.md): the rollout-serving workload and Autoscaling-v0.
- [docs/prefix_caching.md](prefix_caching.md): LLMPrefixRouting-v0; its section "The study
  (p)" holds the learned prefix-cache-aware router against every router with CIs: at 1M
  steps on the registered environment (system prompts, load 1: better than the best router
  on the training trace, level with the best cache-first rules on the mean, better in the
  tail; load 1.5: not resolved against the best on the training trace, `most_cached`, better
  tail and hit rate, better than every production router; Mooncake, load 1: worse than the
  best, the load-only `least_marginal`), and experiment (p) at the quick budget (system prompts, Mooncake), as `python
  scripts/reproduce.py --quick --only p` wrote it (the quick budget skips (p) unless named).
- [docs/benchmarks.md](benchmarks.md): speed (env-steps/s, compile time, PPO training
  throughput).
- [docs/confirmations.md](confirmations.md): (x)'s findings re-measured on fresh training
  seeds and fresh evaluation streams (`python -m jaxserve.scripts.ablate`).
"""


# Routers' information and the heuristic set changed at these commits (issue 25): a section
# written before one of them is flagged in the preamble until it is regenerated.
INFORMATION_CHANGES = (
    ("f3d97b3", "Routing-v0's routers see a noisy output estimate by default (`estimate_mode=1`,"
                " sigma 1.0), not the true size class"),
    ("0658cc1", "the heuristic set includes `sita_predicted` and `sita_prompt` (SITA on the "
                "length predicted from the prompt and the estimate, fitted on tuning streams), "
                "the strongest honest heuristic in (w)"),
    ("eafe997", "the heuristic set includes `sita_tuned` (`sita_predicted` with its orientation "
                "and a spill threshold chosen by simulation on tuning streams)"),
)
_ROUTER_ROW = re.compile(r"\b(sita|jsq|round_robin)\b", re.I)
_WRITTEN_AT = re.compile(r"\*Written by `[^`]*` at commit `(?P<commit>[0-9a-f]+)`")


def _is_ancestor(old: str, new: str) -> bool | None:
    """Whether commit `old` is an ancestor of (or equal to) `new`; None when git cannot tell."""
    r = subprocess.run(["git", "merge-base", "--is-ancestor", old, new], capture_output=True)
    return {0: True, 1: False}.get(r.returncode)


def stale_note(blocks: dict[str, str]) -> str:
    """A preamble paragraph naming each routing section (one naming SITA, JSQ or round robin)
    written before an `INFORMATION_CHANGES` commit (read from its provenance line), or "" when
    none is, or when git cannot tell (a checkout without history)."""
    lines = []
    for change, what in INFORMATION_CHANGES:
        old = []
        for key in sorted(blocks):
            if not _ROUTER_ROW.search(blocks[key]):  # not a routing table: neither change applies
                continue
            m = _WRITTEN_AT.search(blocks[key])
            if m and _is_ancestor(change, m.group("commit")) is False:
                old.append(f"({key})")
        if old:
            lines.append(f"sections {', '.join(old)} predate commit `{change}`, since which {what}")
    if not lines:
        return ""
    return ("**Out-of-date sections.** " + "; ".join(lines) + ". Regenerate them with "
            "`python scripts/reproduce.py --quick --only <keys>` before reading a verdict from "
            "them.\n")


def headline_summary(data: dict) -> str:
    """The page's summary table from section (w)'s data (`{scenario: {"latency": {policy: s},
    "best_heuristic", "diff_vs_best": {mean, low, high}, "budget_curve": [{env_steps, mean},
    ...]}}`): per scenario the learned router, the best heuristic, their paired difference and
    verdict, the best clairvoyant reference, and the learned router's latency along its
    budget curve; "" without (w)."""
    w = data.get("w") or {}
    rows = []
    for name, d in w.items():
        lat, best, diff = d.get("latency"), d.get("best_heuristic"), d.get("diff_vs_best")
        if not (lat and best and diff):
            continue
        learned = next((k for k in lat if k in ("ppo", "reinforce")), None)
        refs = {k: v for k, v in lat.items() if "true lengths" in k}
        ref = min(refs, key=refs.get) if refs else None
        verdict = ("learned wins" if diff["high"] < 0 else "heuristic wins"
                   if diff["low"] > 0 else "no difference resolved")
        curve = ", ".join(f"{pt['env_steps'] / 1e3:.0f}k: {pt['mean']:.3g}"
                          for pt in d.get("budget_curve", []))
        rows.append(f"| {name} | {learned} {lat[learned]:.3g} | {best} {lat[best]:.3g} | "
                    f"{diff['mean']:+.3g} [{diff['low']:+.3g}, {diff['high']:+.3g}] | {verdict} | "
                    + (f"{ref} {lat[ref]:.3g} |" if ref else "none |")
                    + f" {curve or 'not measured'} |")
    short = w.get("short_bursts") or {}
    x_row = _ablation_row(data.get("x") or {}, short)
    y = data.get("y") or {}
    proto = y.get("protocol") or {}
    y_row = _ablation_row(y, short, label=(
        f"short_bursts, (y): {proto.get('variant')} confirmed on {len(proto.get('seeds', []))} "
        "fresh seeds, fresh streams")) if proto else ""
    if not rows:
        return ""
    note = (["The (x) row is the best of (x)'s PPO variants on (w)'s short_bursts streams, "
             "a training choice picked after seeing them: "
             + ("the (y) row re-measures that pick with training seeds and evaluation streams "
                "it was not found on (its protocol fixed before the run), and "
                if y_row else "")
             + "[docs/confirmations.md](confirmations.md) holds the earlier re-measurements.",
             ""] if x_row or y_row else [])
    why = _why_line(y)
    if why:
        note += [why, ""]
    return "\n".join([
        "**Summary: best learned router vs best honest heuristic** (section (w), drop-inclusive "
        "mean latency in s; paired difference with its 95% seed x stream bootstrap CI; the "
        "clairvoyant reference reads true output lengths, a bound no real router reaches; the "
        "budget curve is the learned router's latency after that many training env steps per "
        "seed, so a gap can be read against the budget):",
        "",
        "| scenario | learned | best heuristic | learned - heuristic (95% CI) | verdict | "
        "best clairvoyant | learned along its budget curve (s) |",
        "|---|---|---|---|---|---|---|", *rows, *[r for r in (x_row, y_row) if r], "", *note])


def _why_line(y: dict) -> str:
    """The (y) row's "why", from (y)'s data: where the learned router and the heuristic send
    the short requests that arrive in bursts; "" without it."""
    proto = y.get("protocol") or {}
    v, h = y.get(proto.get("variant")) or {}, y.get(proto.get("heuristic")) or {}
    a, b = v.get("burst_short_to_fast"), h.get("burst_short_to_fast")
    if a is None or b is None:
        return ""
    text = (f"What the (y) row's learned router does differently, from (y)'s per-request "
            f"records: during bursts (which bring short requests only) `{proto['variant']}` "
            f"sends {100 * a:.0f}% of the short requests to the fast GPUs, "
            f"`{proto['heuristic']}` {100 * b:.0f}%.")
    if a > b:
        text += (" SITA's size partition is fitted to the average mix, so in bursts it still "
                 "keeps most short requests off the fast GPUs; a router that reads the queues "
                 "can see when the fast GPUs hold no long requests and use them for short "
                 "ones.")
    return text + "\n"


def _ablation_row(x: dict, w_short: dict, label: str | None = None) -> str:
    """The summary row of (x)'s (or (y)'s) best PPO variant (lowest mean) against its
    heuristic, with (w)'s short_bursts clairvoyant reference; "" without data. `label` names
    the row (default "short_bursts, (x): <variant>")."""
    variants = {k: v for k, v in x.items() if isinstance(v, dict) and "diff_vs_heuristic" in v
                and ": the clone" not in k}
    heur = [k for k, v in x.items() if isinstance(v, dict) and "diff_vs_heuristic" not in v
            and k not in ("least_marginal", "clairvoyant") and "mean" in v]
    if not variants or len(heur) != 1:
        return ""
    best = min(variants, key=lambda k: variants[k]["mean"])
    d, h = variants[best]["diff_vs_heuristic"], heur[0]
    verdict = ("learned wins" if d["high"] < 0 else "heuristic wins" if d["low"] > 0
               else "no difference resolved")
    label = f"short_bursts, (x): {best}" if label is None else label
    if "protocol" in x:  # (y): its own streams, so only its own references apply
        own = x.get("clairvoyant") or {}
        ref_cell = (f"{own['name']} {own['mean']:.3g}" if own else
                    "not measured on these streams")
    else:
        lat = w_short.get("latency") or {}
        refs = {k: v for k, v in lat.items() if "true lengths" in k}
        ref = min(refs, key=refs.get) if refs else None
        ref_cell = f"{ref} {lat[ref]:.3g}" if ref else "none"
    return (f"| {label} | {best} {variants[best]['mean']:.3g} | "
            f"{h} {x[h]['mean']:.3g} | {d['mean']:+.3g} [{d['low']:+.3g}, {d['high']:+.3g}] | "
            f"{verdict} | {ref_cell} | not measured |")


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


_SECTION = re.compile(r"^## \((\w+)\)", re.M)
_RUN_LINE = re.compile(r"^This run: `(?P<cmd>[^`]*)` .*?at commit `(?P<commit>[^`]*)`", re.M | re.S)


def split_page(text: str) -> tuple[str, dict[str, str]]:
    """`(preamble, {key: block})` of a results page: each block runs from its `## (key) ...`
    heading to the next level-2 heading (subsections stay inside)."""
    starts = [(m.start(), m.group(1)) for m in _SECTION.finditer(text)]
    if not starts:
        return text, {}
    ends = [s for s, _ in starts[1:]] + [len(text)]
    return text[:starts[0][0]], {k: text[s:e].rstrip() + "\n" for (s, k), e in
                                 zip(starts, ends)}


def _provenance(command: str, commit: str, budget: str | None = None) -> str:
    b = f", budget `{budget}`" if budget else ""
    return f"*Written by `{command}` at commit `{commit}`{b}.*"


def _kept_block(block: str, preamble: str) -> str:
    """An old section kept by a partial run; one written before sections carried their own
    provenance gets the old page's run line (its command and commit) added."""
    if "*Written by `" in block:
        return block
    m = _RUN_LINE.search(preamble)
    if m is None:
        return block
    head, _, rest = block.partition("\n")
    return f"{head}\n\n{_provenance(m.group('cmd'), m.group('commit'))}\n{rest}"


def _section_block(sec: Section, ctx: Context, commit: str, md_path: Path,
                   fig_dir: Path) -> str:
    lines = [f"## {sec.title}", "", _provenance(ctx.command, commit, ctx.budget.name)
             + f" *Wall time of this experiment: {sec.wall_s:.0f} s.*", "", sec.body]
    for name, draw in sec.figures.items():
        draw(fig_dir / name)
        rel = Path(*(fig_dir.resolve().relative_to(md_path.parent.resolve()).parts),
                   name) if fig_dir.resolve().is_relative_to(md_path.parent.resolve()) \
            else fig_dir / name
        lines += ["", f"![{sec.title}]({rel.as_posix()})"]
    return "\n".join(lines) + "\n"


def write_results(sections: Sequence[Section], ctx: Context, md_path, fig_dir,
                  wall_s: float, merge: bool = False, json_path=None) -> Path:
    """Writes `md_path` (markdown), its figures under `fig_dir` and its data as JSON at
    `json_path` (default: `md_path` with the suffix `.json`; `scripts/reproduce.py` keeps the
    page's data in `lab/results.json`, outside the documentation).

    With `merge` and an existing page, only the sections run now are replaced (matched by
    their `(key)` heading) and their JSON entries updated; every other section keeps its text,
    its figures and its provenance line (command and commit), so one experiment can be
    regenerated without rerunning the others. Sections are ordered by key.
    """
    md_path, fig_dir = Path(md_path), Path(fig_dir)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    fig_dir.mkdir(parents=True, exist_ok=True)
    json_path = md_path.with_suffix(".json") if json_path is None else Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    commit = _git_commit()
    blocks, data = {}, {}
    if merge and md_path.exists():
        old_pre, old_blocks = split_page(md_path.read_text())
        blocks = {k: _kept_block(v, old_pre) for k, v in old_blocks.items()}
        if json_path.exists():
            data = json.loads(json_path.read_text())
    new_keys = [s.key for s in sections]
    for sec in sections:
        blocks[sec.key] = _section_block(sec, ctx, commit, md_path, fig_dir)
        data[sec.key] = _jsonable(sec.data)
    b = ctx.budget
    cpu = platform.processor() or platform.machine()
    kept = sorted(set(blocks) - set(new_keys))
    if not new_keys:  # `--only ""`: the summary and this line from the kept sections' data
        scope = ("it ran no experiment and rewrote only the summary above the sections, from "
                 "the data of (" + "), (".join(kept) + ") as earlier runs wrote them (each "
                 "section names the command and commit that wrote it)")
    elif kept:
        scope = (f"it rewrote section(s) {', '.join(f'({k})' for k in new_keys)} and kept "
                 f"{', '.join(f'({k})' for k in kept)} from earlier runs (each section names "
                 f"the command and commit that wrote it)")
    else:
        scope = "it wrote every section"
    lines = ["# Results", "", INTRO,
             f"Last run: `{ctx.command}` (budget `{b.name}`: seeds {list(b.seeds)}, "
             f"{b.routing_steps} routing / {b.batching_steps} batching training steps per run)"
             f", at commit `{commit}` (plus uncommitted changes, if any), on "
             f"{jax.default_backend()} ({jax.device_count()} device(s), {cpu}); wall time "
             f"**{wall_s / 60:.1f} min**; {scope}. On a shared CPU the wall times are noisy.",
             "", STUDY_NOTE]
    summary = headline_summary(data)
    if summary:
        lines += [summary]
    lines += ["", OTHER_PAGES]
    note = stale_note(blocks)
    if note:
        lines += [note]
    page = "\n".join(lines) + "".join("\n" + blocks[k] for k in sorted(blocks))
    md_path.write_text(page)
    json_path.write_text(json.dumps({k: data[k] for k in sorted(data)}, indent=1,
                                    allow_nan=False))
    return md_path
