"""MkDocs hook (mkdocs.yml `hooks:`): lets mkdocstrings find `jaxserve.agents`.

The package maps the top-level folders `agents/` and `scripts/` to `jaxserve.agents` and
`jaxserve.scripts` (pyproject's `package-dir`). Griffe, which reads the sources for
mkdocstrings, looks a subpackage up as a folder inside its parent (`jaxserve/agents/`), so it
cannot see the mapping. Before the build this hook writes `build/griffe/jaxserve/`: a folder of
symbolic links to every entry of `jaxserve/`, plus `agents` and `scripts` linked to those
folders; mkdocs.yml points the handler's `paths` there. Nothing is copied, the tree is not
touched, and `build/` is ignored by git.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent
OVERLAY = ROOT / "build" / "griffe"
MAPPED = {"agents": ROOT / "agents", "scripts": ROOT / "scripts"}


def build_overlay(root: Path = ROOT, overlay: Path = OVERLAY) -> Path:
    """Writes `overlay/jaxserve/` (links to `root/jaxserve/*` and the mapped folders)."""
    pkg = overlay / "jaxserve"
    if overlay.exists():
        shutil.rmtree(overlay)
    pkg.mkdir(parents=True)
    for entry in (root / "jaxserve").iterdir():
        if entry.name != "__pycache__":
            os.symlink(entry, pkg / entry.name)
    for name, folder in MAPPED.items():
        os.symlink(folder, pkg / name)
    return overlay


@event_priority(100)  # before mkdocstrings loads anything
def on_config(config, **kwargs):
    build_overlay()
    return config
