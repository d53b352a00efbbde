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
          "jaxserve.workloads", "jaxserve.policies", "jaxserve.evaluation", "agents", "scripts")
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
    parts = path.relative_to(ROOT).with_suffix("").parts
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
    tree = ast.parse("import agents\ndef f():\n    from scripts.bench import main\n"
                     "from jaxserve import traces\nfrom jaxserve import make\n")
    targets = [m for m, _ in imported_modules(tree)]
    assert sorted(targets) == ["agents", "jaxserve", "jaxserve.traces", "scripts.bench"]
    assert layer_of("scripts.bench") > layer_of("agents") > layer_of("jaxserve")
    assert layer_of("jaxserve.evaluation.stats") > layer_of("jaxserve.core.stats")
    assert layer_of("jaxserve.core") == 1 and layer_of("numpy") is None
    assert layer_of("jaxserve.reference.sim") < layer_of("jaxserve.core.replica")
