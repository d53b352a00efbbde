"""Experiments that regenerate docs/results.md: one function per experiment, in a list.

An experiment is `fn(ctx: Context) -> Section` registered with `@experiment(key, title)`;
`run_experiments` runs the selected ones in key order (later ones may reuse what earlier
ones left in `ctx.cache`, e.g. the trained routers), and `report.write_results`
turns the sections into markdown and figures. `scripts/reproduce.py` is the command line.

Modules: `budget` (quick, full and tiny budgets), `common` (training several seeds in one
program, seed statistics, markdown tables), `scenarios` (every scenario, fixed up front with
its reason), `routing` (a, c, e), `batching` (b), `generalisation` (d),
`llm_routing` (f, skipped by the quick and tiny budgets unless named), `prefix_routing`
(p: prefix-cache-aware routing, `prefix_study`; skipped likewise), `routing_win` (w:
honest information, headroom, learned vs best heuristic), `ablation` (x: what (w)'s win rests
on; skipped by the quick and tiny budgets unless named), `confirmation` (y: the pick of (x)
re-measured on fresh seeds and streams; skipped likewise), `report`.
"""

from jaxserve.agents.experiments.budget import BUDGETS, Budget
from jaxserve.agents.experiments.common import Context, Section
from jaxserve.agents.experiments.registry import EXPERIMENTS, experiment, run_experiments
# Importing the experiment modules registers them.
from jaxserve.agents.experiments import (ablation, batching, confirmation,  # noqa: F401,E402
                                 generalisation, llm_routing, prefix_routing, routing,
                                 routing_win)

__all__ = ["BUDGETS", "Budget", "Context", "EXPERIMENTS", "Section", "experiment",
           "run_experiments"]
