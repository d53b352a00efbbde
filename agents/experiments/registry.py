"""The experiment list: `@experiment(key, title)` adds `fn(ctx) -> Section` to `EXPERIMENTS`."""

from __future__ import annotations

import dataclasses
import gc
import time
import traceback
from typing import Callable, Sequence

import jax

from jaxserve.agents.experiments.common import Context, Section


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A registered experiment: `key` (short id, e.g. "b"), `title`, `fn(ctx) -> Section`."""

    key: str
    title: str
    fn: Callable[[Context], Section]


EXPERIMENTS: list[Experiment] = []


def experiment(key: str, title: str):
    """Decorator registering `fn(ctx) -> Section` under `key` (run in registration order)."""
    def deco(fn):
        if any(e.key == key for e in EXPERIMENTS):
            raise ValueError(f"experiment {key!r} is already registered")
        EXPERIMENTS.append(Experiment(key, title, fn))
        return fn
    return deco


def select(keys: Sequence[str] | None, skip: Sequence[str] = ()) -> list[Experiment]:
    """The experiments to run, in key order: those named by `keys`, or (`keys=None`) all but
    the budget's `skip`. Raises ValueError for an unknown key."""
    known = [e.key for e in EXPERIMENTS]
    if keys is not None:
        unknown = sorted(set(keys) - set(known))
        if unknown:
            raise ValueError(f"unknown experiment(s) {unknown}; registered: {known}")
    wanted = set(keys) if keys is not None else set(known) - set(skip)
    return [e for e in sorted(EXPERIMENTS, key=lambda e: e.key) if e.key in wanted]


def run_experiments(ctx: Context, keys: Sequence[str] | None = None) -> list[Section]:
    """Runs the experiments named by `keys` (default: all but the budget's `skip`), in key
    order ((a), (b), ...; (d) and (e) reuse the routers (c) trained, and train them if (c)
    did not run).

    Raises ValueError for an unknown key. Each section records its own wall time. With
    `ctx.keep_going` an experiment that raises becomes a section saying so (and the run
    goes on); otherwise the error propagates.
    """
    sections = []
    for e in select(keys, ctx.budget.skip):
        ctx.log(f"experiment ({e.key}) {e.title}")
        t0 = time.perf_counter()
        try:
            sec = e.fn(ctx)
        except Exception as err:  # noqa: BLE001  (one failure must not lose the other results)
            if not ctx.keep_going:
                raise
            ctx.log(f"experiment ({e.key}) FAILED: {traceback.format_exc()}")
            sec = Section(e.title, f"**This experiment failed in this run:** "
                          f"`{type(err).__name__}: {err}`", data={"failed": str(err)})
        sec.wall_s = time.perf_counter() - t0
        sec.key = e.key
        ctx.log(f"experiment ({e.key}) done in {sec.wall_s:.0f} s")
        sections.append(sec)
        # XLA:CPU keeps every compiled program's code in its own memory maps; one process
        # running every experiment could reach vm.max_map_count (docs/troubleshooting.md).
        jax.clear_caches()
        gc.collect()
    return sections
