"""A persistent XLA compilation cache for jaxserve's command-line tools (and anyone's code).

JAX compiles every program anew in each process unless its persistent compilation cache is
on (`jax_compilation_cache_dir`). jaxserve's programs are large, and their compile time is a
good part of a short run: the main job (`jaxserve-train`) ran in 45.6 s cold and 33.6 s with
the cache warm (README). Entries are keyed by the program, the jax/jaxlib versions, the backend and the compile
options, so a changed program or a new jax compiles afresh; nothing but compile time depends
on the cache.

`enable_compilation_cache` turns it on; `scripts.cli.run_cli` (every `jaxserve-*` tool)
calls it. `scripts/bench.py` turns caching off, since it reports cold compile times.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax

CACHE_ENV = "JAXSERVE_XLA_CACHE"
_OFF = ("0", "off", "false", "no", "none")


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/jaxserve/xla`, or `~/.cache/jaxserve/xla` without XDG_CACHE_HOME."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxserve" / "xla"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Points JAX's persistent compilation cache at a folder and returns it (None if off).

    The folder is, in order: `path`; the environment variable `JAXSERVE_XLA_CACHE` (a
    folder, or one of 0/off/false/no/none to turn the cache off: then nothing is changed);
    the folder JAX is already configured with (`JAX_COMPILATION_CACHE_DIR` or
    `jax.config`); `default_cache_dir()`. JAX's own thresholds apply (by
    default only programs that took >= 1 s to compile are stored). A folder that cannot be
    created or written is reported with a warning and the cache stays off: a cache is never
    a reason for a run to fail. It takes effect from the next compilation on (programs
    compiled before, e.g. by imports, are not stored).
    """
    if path is None:
        env = os.environ.get(CACHE_ENV)
        if env is not None and env.strip().lower() in _OFF:
            return None
        if env:
            path = env
        elif jax.config.jax_compilation_cache_dir:
            path = jax.config.jax_compilation_cache_dir
        else:
            path = default_cache_dir()
    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"XLA compilation cache off: cannot create {folder} ({e.strerror})",
                      stacklevel=2)
        return None
    if not os.access(folder, os.W_OK):
        warnings.warn(f"XLA compilation cache off: {folder} is not writable", stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    return str(folder)
