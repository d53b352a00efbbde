"""Test-session configuration: an opt-in persistent XLA compilation cache shared by one test run.

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
**Off by default** since 2026-12-03: with the cache shared, an xdist worker died with a
segmentation fault inside `compilation_cache.get_executable_and_time`, i.e. while XLA:CPU
deserialized an entry (test_continuous_engine::test_dyadic_matches_reference_exactly under `-n
2` with the other LLM test files), and two earlier full runs lost a worker to SIGABRT while
compiling. It is not a write race: it happened again with JAX's file lock on (a size limit set,
`filelock` installed), and the same entries read back in a fresh process, one at a time, load
fine. So loading a cached executable into a worker that has already run other programs can
crash; not diagnosed further (suspect: a program of the continuous engine's closed-form decode
run, which appeared with these crashes). Turning it on costs that risk for ~15-20% of CPU time.

`JAXSERVE_TEST_XLA_CACHE=1` turns it on (shared, with JAX's file lock when `filelock` is installed).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import jax

_MARK = "JAXSERVE_TEST_XLA_CACHE_DIR"  # set by the controller, seen by workers and children
_created: list[str] = []


# 4 GiB, far above what a run writes (one engine test: 360 KB), so nothing is evicted: the limit
# exists to turn the lock on.
_CACHE_MAX_BYTES = 1 << 32


def _cache_max_bytes() -> int:
    """The cache's size limit: `_CACHE_MAX_BYTES` (so JAX locks it) with `filelock`, else none (-1)."""
    try:
        import filelock  # noqa: F401  (JAX's cache lock)
    except ImportError:
        return -1
    return _CACHE_MAX_BYTES


def pytest_configure(config):
    if os.environ.get("JAXSERVE_TEST_XLA_CACHE", "0") != "1":
        return
    cache_dir = os.environ.get(_MARK)
    if cache_dir is None:  # the controller (or a run without xdist): a fresh directory
        cache_dir = tempfile.mkdtemp(prefix="jaxserve-xla-cache-")
        _created.append(cache_dir)
        os.environ.update({_MARK: cache_dir, "JAX_COMPILATION_CACHE_DIR": cache_dir,
                           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
                           "JAX_COMPILATION_CACHE_MAX_SIZE": str(_cache_max_bytes())})
    # jax is already imported (this module imports it), so its flags are set directly too.
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", _cache_max_bytes())


def pytest_unconfigure(config):
    for cache_dir in _created:  # only the process that created it removes it
        shutil.rmtree(cache_dir, ignore_errors=True)
