"""The repository's shape: docs/ is the site a user reads, lab/ the notebook beside it.

- no tracked file over 1 MB (raw results, weights and logs belong in lab/, which has the same
  budget: lab/README.md);
- no raw data (.json, .msgpack, .npz, .pkl) under docs/;
- no absolute filesystem path (a developer's machine) in the code, tests, docs or README;
- every page of mkdocs.yml's nav exists, and every page under docs/ is in the nav (MkDocs
  builds pages left out of the nav but nobody finds them).

Building the site (`mkdocs build --strict`) is CI's job (.ci/run), not a test's: it needs the
`docs` extra and takes longer than this file.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_BYTES = 1_000_000
RAW_SUFFIXES = {".json", ".msgpack", ".npz", ".pkl"}
# A developer's or a CI machine's paths; relative paths (runs/, ../shared/) are fine.
ABSOLUTE_PATH = re.compile(r"/work/|/root/|/home/|/tmp/|\bC:\\")
SCANNED = ("jaxserve/", "agents/", "scripts/", "tests/", "docs/", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".yml", ".yaml", ".toml", ".cfg", ".ini", ".sh", ".rst"}


def _tracked() -> list[str]:
    """`git ls-files` (tracked and staged paths), or skip where this is not a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout (or no git): tracked files unknown")
    return [p for p in out.decode().split("\0") if p]


def test_no_tracked_file_over_1mb():
    big = []
    for rel in _tracked():
        path = ROOT / rel
        if path.is_file() and not path.is_symlink() and path.stat().st_size > MAX_BYTES:
            big.append(f"{rel} ({path.stat().st_size:,} bytes)")
    assert not big, f"tracked files over {MAX_BYTES:,} bytes (lab/README.md): {big}"


def test_no_raw_data_under_docs():
    raw = sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*")
                 if p.is_file() and p.suffix.lower() in RAW_SUFFIXES)
    assert not raw, f"raw data belongs in lab/, not in the site: {raw}"


def test_no_absolute_paths():
    this = Path(__file__).resolve()
    hits = []
    for rel in _tracked():
        path = ROOT / rel
        if (not rel.startswith(SCANNED) or path.suffix.lower() not in TEXT_SUFFIXES
                or not path.is_file() or path.resolve() == this):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if ABSOLUTE_PATH.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, "absolute paths (use relative ones, e.g. runs/...):\n" + "\n".join(hits)


def test_absolute_path_pattern():
    for bad in ("--out /tmp/x.md", "/home/me/jaxserve", "/work/main/docs", "/root/.cache",
                "C:\\Users\\me", r"C:\\Users\\me"):
        assert ABSOLUTE_PATH.search(bad), bad
    for ok in ("--out runs/x.md", "../shared/ROUTERS.md", "lab/bench/bench_cpu.json",
               "/usr/bin/time", "https://github.com/x/y", r"ABC:\s+", "tmp_path / 'x'"):
        assert not ABSOLUTE_PATH.search(ok), ok


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [] if re.match(r"^[a-z]+://", node) else [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


class _Loader(yaml.SafeLoader):
    """safe_load that reads MkDocs' `!!python/name:` and `!ENV` tags as plain values."""


_Loader.add_multi_constructor("", lambda loader, suffix, node: None)


def _config() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)


def test_mkdocs_config():
    config = _config()
    assert config["docs_dir"] == "docs"
    assert config.get("strict") is True
    assert config["theme"]["name"] == "material"
    plugins = [next(iter(p)) if isinstance(p, dict) else p for p in config["plugins"]]
    assert "mkdocstrings" in plugins


def test_nav_pages_exist_and_every_page_is_in_nav():
    nav = _nav_pages(_config()["nav"])
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    missing = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing, f"in mkdocs.yml's nav but not under docs/: {missing}"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    orphans = sorted(pages - set(nav))
    assert not orphans, f"pages under docs/ missing from mkdocs.yml's nav: {orphans}"


def test_reproduce_keeps_the_page_data_in_lab(monkeypatch, tmp_path):
    """`scripts/reproduce.py` writes docs/results.md, and its data beside the notebook, not the
    site: lab/results.json by default, next to `--out` when the page goes elsewhere."""
    import jaxserve.scripts.reproduce as reproduce

    written = []
    monkeypatch.setattr(reproduce, "run_experiments", lambda ctx, only: [])
    monkeypatch.setattr(reproduce, "write_results",
                        lambda sections, ctx, out, figs, wall_s, merge=False, json_path=None:
                        written.append((Path(out), Path(json_path))) or Path(out))
    assert reproduce.main(["--budget", "tiny", "--only", ""]) == 0
    assert reproduce.main(["--budget", "tiny", "--only", "", "--out", str(tmp_path / "r.md")]) == 0
    assert written == [(DOCS / "results.md", ROOT / "lab" / "results.json"),
                       (tmp_path / "r.md", tmp_path / "r.json")]


# Labels a reader of the code cannot resolve: a tracker's issue numbers ("issue 25", "issue
# #50") and the benchmark history's run letters ("run [O]"). A comment says what is meant and,
# for a measurement, the file and section that hold it (lab/history/benchmarks.md, ...).
INTERNAL_LABEL = re.compile(r"\bissue[ #-]*\d+|\bruns? \[[A-Z]\]", re.IGNORECASE)
CODE_DIRS = ("jaxserve", "agents", "scripts", "tests")


def test_no_issue_numbers_or_run_letters_in_code():
    this = Path(__file__).resolve()
    hits = []
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.resolve() == this:
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if INTERNAL_LABEL.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, ("issue numbers or run letters in code (say what is meant, and where a "
                      "measurement lives, in plain words):\n" + "\n".join(hits))


def test_internal_label_pattern():
    for bad in ("(issue 25)", "Issue #50, 3.", "issue-12 study", "issue 21's formula",
                "docs/benchmarks.md, run [O]", "runs [A] to [Q]"):
        assert INTERNAL_LABEL.search(bad), bad
    for ok in ("docs/results.md, section (x)", "lab/history/benchmarks.md", "E[S^2]",
               "an issue with 2 replicas", "tissue 3", "rerun [O"):
        assert not INTERNAL_LABEL.search(ok), ok
