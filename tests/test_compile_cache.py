"""`jaxserve.compile_cache`: the CLIs' persistent XLA compilation cache.

The in-process tests restore JAX's cache folder afterwards (the test session runs with its
own per-run cache, `tests/conftest.py`). The subprocess test checks the point of it all: a
second process that runs the same program loads it from the cache (JAX's `cache_hits` event)
instead of compiling it, and computes the same value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from jaxserve import compile_cache as CC

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_jax_cache_dir():
    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)
    jax_cache.reset_cache()


def test_off_changes_nothing(monkeypatch, restore_jax_cache_dir):
    before = jax.config.jax_compilation_cache_dir
    for off in ("0", "off", "OFF", " none "):
        monkeypatch.setenv(CC.CACHE_ENV, off)
        assert CC.enable_compilation_cache() is None
        assert jax.config.jax_compilation_cache_dir == before


def test_folder_from_argument_or_environment(tmp_path, monkeypatch, restore_jax_cache_dir):
    got = CC.enable_compilation_cache(tmp_path / "a" / "b")
    assert got == str(tmp_path / "a" / "b") and Path(got).is_dir()
    assert jax.config.jax_compilation_cache_dir == got
    monkeypatch.setenv(CC.CACHE_ENV, str(tmp_path / "env"))
    assert CC.enable_compilation_cache() == str(tmp_path / "env")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "env")


def test_keeps_a_folder_jax_already_has(tmp_path, monkeypatch, restore_jax_cache_dir):
    monkeypatch.delenv(CC.CACHE_ENV, raising=False)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    assert CC.enable_compilation_cache() == str(tmp_path / "jax")


def test_default_folder_follows_xdg(tmp_path, monkeypatch, restore_jax_cache_dir):
    monkeypatch.delenv(CC.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    jax.config.update("jax_compilation_cache_dir", None)
    assert CC.default_cache_dir() == tmp_path / "jaxserve" / "xla"
    assert CC.enable_compilation_cache() == str(tmp_path / "jaxserve" / "xla")


def test_unusable_folder_warns_and_stays_off(tmp_path, restore_jax_cache_dir):
    before = jax.config.jax_compilation_cache_dir
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match="compilation cache off"):
        assert CC.enable_compilation_cache(blocker / "cache") is None
    assert jax.config.jax_compilation_cache_dir == before


_CHILD = """
import json, jax, jax.numpy as jnp
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
import jaxserve.scripts.train  # noqa: F401 (as a CLI does: its imports compile before the cache is on)
x = jnp.arange(8.0)
from jaxserve.compile_cache import enable_compilation_cache
folder = enable_compilation_cache()
y = float(jax.jit(lambda v: jnp.sin(v).sum() * 3.0 + v.max())(x))
print(json.dumps({"folder": folder, "hits": len(hits), "y": y}))
"""


def test_a_second_process_loads_the_program(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update({CC.CACHE_ENV: str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu",
                # this program compiles in milliseconds; JAX stores only >= 1 s by default
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "PYTHONPATH": str(ROOT)})

    def child():
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = child(), child()
    assert first["folder"] == str(tmp_path / "cache")
    assert any((tmp_path / "cache").iterdir())
    assert first["hits"] == 0 and second["hits"] >= 1
    assert second["y"] == first["y"]
