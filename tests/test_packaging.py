"""What `pip install` puts on a user's machine: everything under `jaxserve`, nothing under a
generic top-level name, every console script importable, a LICENSE beside the code.

Reads pyproject.toml (Python's tomllib) rather than building a wheel: the package list there is
what setuptools installs, and building would take longer than the rest of this file.
"""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _package_of(folder: Path) -> str:
    """The installed dotted name of a source folder under the mapping in pyproject.toml."""
    rel = folder.relative_to(ROOT).parts
    for name, src in sorted(SETUPTOOLS["package-dir"].items(), key=lambda kv: -len(kv[1])):
        src_parts = Path(src).parts
        if rel[:len(src_parts)] == src_parts:
            return ".".join([name, *rel[len(src_parts):]])
    raise AssertionError(f"{folder} is not under any mapped folder")


def test_every_python_package_folder_is_listed_and_nothing_else():
    """A new subpackage that is not added to `packages` would be missing from a wheel (setuptools
    cannot discover mapped folders); a listed one that does not exist would fail the build."""
    folders = {_package_of(p.parent) for top in SETUPTOOLS["package-dir"].values()
               for p in (ROOT / top).rglob("__init__.py")}
    assert sorted(folders) == sorted(SETUPTOOLS["packages"])


def test_nothing_installs_under_a_generic_top_level_name():
    tops = {p.split(".")[0] for p in SETUPTOOLS["packages"]}
    assert tops == {"jaxserve"}
    assert set(SETUPTOOLS["package-dir"]) == {"jaxserve", "jaxserve.agents", "jaxserve.scripts"}


def test_every_console_script_points_at_a_main_it_can_import():
    for name, target in PYPROJECT["project"]["scripts"].items():
        module, _, func = target.partition(":")
        assert module.startswith("jaxserve."), name
        assert callable(getattr(importlib.import_module(module), func)), name


def test_license_file_matches_the_declared_licence():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
