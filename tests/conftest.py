"""Test-session configuration: one persistent XLA compilation cache per test run.

Most of the suite's time is XLA compilation, and under pytest-xdist every worker is its own
process that compiles every program it runs, although many are the same program. The
controller creates a temporary cache directory, points `jax_compilation_cache_dir` at it with
no minimum compile time or entry size, and exports the same settings as JAX's environment
variables, which the xdist workers and the CLIs that tests run as subprocesses inherit. A
program compiled by one process is then loaded instead of compiled again. The directory lives
for one run only, so no result or timing depends on what an earlier run left behind.

Measured with `-n 2` on the shared 2-core CPU (user CPU time, cache off -> on, two runs each):
tests/test_honest_eval.py + tests/test_evaluate.py 157 -> 132 s and 149 -> 120 s;
tests/test_agents_checkpoint.py 93 -> 94 s (both workers compile its one trainer at once).
Without `filelock` JAX does not lock the cache: a worker reading an entry another is writing
gets a decompression error, which JAX reports as a warning before compiling the program
itself, so a race costs time, never a result.

`JAXSERVE_TEST_XLA_CACHE=0` turns it off, and with it the CLIs' own cache
(`JAXSERVE_XLA_CACHE=off`), so that no test writes to the user's home. With it on, the CLIs
that tests run use this run's folder (`jaxserve.compile_cache` keeps a folder JAX already has).

The public trace files: when the trace mirror `../shared/traces` exists beside the repository,
`JAXSERVE_TRACES_DIR` defaults to it (an explicit setting wins), so that the tests that read
traces find them through `jaxserve.traces.path` like a user's code; without it they skip.

XLA's optimisation level is left at its default. Tried: `--xla_backend_optimization_level=0`
cut one LLMRouting-v0 program's compile CPU time 28.9 -> 20.6 s, but its rounding differs
from the default build's in the last bit, and the LLM learnability test, whose JSQ-by-tokens
margin is thin, then failed in CI (PPO - JSQ by tokens -0.04 [-0.11, +0.02] s, where the
default build gives -0.07 [-0.11, -0.02]): tests must check the programs users run.

The README's test command distributes whole files (`pytest -n 2 --dist loadfile`): a
module's tests run on one worker, one after another, so a module-scoped fixture (a study, a
recorded episode) is computed once and the module's tests share its compiled programs until
the release below. `--dist loadgroup` does not group under pytest 9.2 with pytest-xdist 3.8
(xdist appends the group to `Node._nodeid`, which pytest 9 no longer reads; checked: the
tests of a module marked `xdist_group` ran on both workers, and tests/test_prefix_study.py's
94-s study fixture ran twice in one CI run).

After each test module every compiled program is released (`jax.clear_caches()` and a garbage
collection). XLA:CPU keeps each executable's JIT code in its own memory maps, and JAX keeps
every executable a process compiled; an xdist worker that runs half the suite then reaches
Linux's default `vm.max_map_count` (65,530) and dies with a segmentation fault inside the next
compile or cache load. Measured: tests/test_continuous_engine.py alone leaves a process with
16,620 maps, 1,497 after the release. Programs shared across modules are then loaded from the
cache above instead of kept mapped.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

import jax
import pytest

_MARK = "JAXSERVE_TEST_XLA_CACHE_DIR"  # set by the controller, seen by workers and children


# Session default for the trace files (see the module doc); set on import, before any test
# module computes a trace path, in the controller and every xdist worker alike.
_MIRROR = (Path(__file__).resolve().parents[1].parent / "shared" / "traces").resolve()
if _MIRROR.is_dir():
    os.environ.setdefault("JAXSERVE_TRACES_DIR", str(_MIRROR))
_created: list[str] = []


def pytest_configure(config):
    if os.environ.get("JAXSERVE_TEST_XLA_CACHE", "1") == "0":
        # nor the CLIs' own cache in the user's home (`jaxserve.compile_cache`)
        os.environ.setdefault("JAXSERVE_XLA_CACHE", "off")
        return
    cache_dir = os.environ.get(_MARK)
    if cache_dir is None:  # the controller (or a run without xdist): a fresh directory
        cache_dir = tempfile.mkdtemp(prefix="jaxserve-xla-cache-")
        _created.append(cache_dir)
        os.environ.update({_MARK: cache_dir, "JAX_COMPILATION_CACHE_DIR": cache_dir,
                           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
    # jax is already imported (this module imports it), so its flags are set directly too.
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    for cache_dir in _created:  # only the process that created it removes it
        shutil.rmtree(cache_dir, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop every cached executable so its memory maps are unmapped."""
    yield
    jax.clear_caches()
    gc.collect()
