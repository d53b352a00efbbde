"""Dependencies point one way: reference <- core <- traces <- envs <- workloads <- policies <-
evaluation <- agents <- scripts (`jaxserve.reference`, the pure-Python simulators the engines are
tested against, imports nothing of jaxserve).

Walks every module of `jaxserve`, `agents` and `scripts` with `ast` (imports at module top and
inside functions alike, since a function-level import is a dependency too) and fails on an
import of a higher layer from a lower one. `jaxserve/__init__.py` and `jaxserve/gymnasium.py`
are the package's front door (they re-export envs, policies and evaluation) and sit at the
evaluation layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("jaxserve.reference", "jaxserve.core", "jaxserve.traces", "jaxserve.envs",
          "jaxserve.workloads", "jaxserve.policies", "jaxserve.evaluation", "jaxserve.agents",
          "jaxserve.scripts")
# The top-level folders agents/ and scripts/ install as these subpackages (pyproject.toml).
FOLDER_PACKAGES = {"agents": "jaxserve.agents", "scripts": "jaxserve.scripts"}
FRONT_DOORS = {"jaxserve": "jaxserve.evaluation", "jaxserve.gymnasium": "jaxserve.evaluation"}


def layer_of(module: str) -> int | None:
    module = FRONT_DOORS.get(module, module)
    found = None
    for i, name in enumerate(LAYERS):
        if module == name or module.startswith(name + "."):
            found = i
    return found


def imported_modules(tree: ast.AST) -> list[tuple[str, int]]:
    """(module, line) of every absolute import in `tree`.

    `from a import b` depends on `a.b` when that is a module of a layer (`from jaxserve import
    traces`), else on `a` itself (`from jaxserve import make` goes through the front door).
    """
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if node.module in FRONT_DOORS and layer_of(sub) is not None:
                    out.append((sub, node.lineno))  # a subpackage, e.g. jaxserve.traces
                else:
                    out.append((node.module, node.lineno))
    return out


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = FOLDER_PACKAGES.get(parts[0], parts[0])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def upward_imports() -> list[str]:
    found = []
    files = [p for pkg in ("jaxserve", "agents", "scripts") for p in (ROOT / pkg).rglob("*.py")]
    for path in sorted(files):
        mod = module_name(path)
        mine = layer_of(mod)
        for target, line in imported_modules(ast.parse(path.read_text(), str(path))):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{mod}:{line} imports {target} ({LAYERS[theirs]} is above "
                             f"{LAYERS[mine]})")
    return sorted(set(found))


def test_no_import_points_up_a_layer():
    assert upward_imports() == []


def test_the_walk_sees_imports_that_point_up():
    tree = ast.parse("from jaxserve import agents\ndef f():\n"
                     "    from jaxserve.scripts.bench import main\n"
                     "from jaxserve import traces\nfrom jaxserve import make\n")
    targets = [m for m, _ in imported_modules(tree)]
    assert sorted(targets) == ["jaxserve", "jaxserve.agents", "jaxserve.scripts.bench",
                               "jaxserve.traces"]
    assert layer_of("jaxserve.scripts.bench") > layer_of("jaxserve.agents") > layer_of("jaxserve")
    assert module_name(ROOT / "agents" / "ppo.py") == "jaxserve.agents.ppo"


def test_nothing_imports_the_folders_by_their_bare_names():
    """`agents` and `scripts` are not installed top-level packages: `import agents` works only
    from the repository root, so any such import is a bug for an installed user."""
    found = []
    for pkg in ("jaxserve", "agents", "scripts", "tests"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for target, line in imported_modules(ast.parse(path.read_text(), str(path))):
                if target.split(".")[0] in FOLDER_PACKAGES:
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert found == []
    assert layer_of("jaxserve.evaluation.stats") > layer_of("jaxserve.core.stats")
    assert layer_of("jaxserve.core") == 1 and layer_of("numpy") is None
    assert layer_of("jaxserve.reference.sim") < layer_of("jaxserve.core.replica")


# ---- imports at module top (a deferred import says why, `# deferred: <why>`)

DEFERRED_MARK = "# deferred:"


def deferred_imports(tree: ast.AST, lines: list[str]) -> list[tuple[int, str, bool]]:
    """(line, statement, justified) of every import inside a function body; justified when
    the statement's first line or the line above it carries `# deferred: <why>`."""
    out, seen = [], set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in seen:
                seen.add(id(node))
                near = lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1
                                                 else "")
                out.append((node.lineno, ast.unparse(node), DEFERRED_MARK in near))
    return out


def unjustified_deferred_imports() -> list[str]:
    found = []
    files = [p for pkg in ("jaxserve", "agents", "scripts") for p in (ROOT / pkg).rglob("*.py")]
    for path in sorted(files):
        text = path.read_text()
        for line, stmt, ok in deferred_imports(ast.parse(text, str(path)), text.splitlines()):
            if not ok:
                found.append(f"{path.relative_to(ROOT)}:{line}: {stmt}")
    return found


def test_imports_sit_at_module_top_unless_a_reason_is_given():
    """An import inside a function hides a dependency from the reader and from the layer walk's
    overview; one stays only with `# deferred: <why>` (a cycle, matplotlib's backend choice)."""
    assert unjustified_deferred_imports() == []


def test_the_deferred_import_check_sees_unmarked_ones():
    src = ("import os\ndef f():\n    import json\n    # deferred: a cycle\n"
           "    from a import b\n    import c  # deferred: backend\n"
           "    def g():\n        import d\n")
    found = deferred_imports(ast.parse(src), src.splitlines())
    assert sorted((ln, ok) for ln, _, ok in found) == [(3, False), (5, True), (6, True),
                                                       (8, False)]
