"""The package's shape, checked from its source: no import cycle between its parts, no oversized module.

A *part* is a subpackage (``checkpoint``, ``straggler``...) or a top-level module (``collective``, ``policy``...).
An import that runs when a module is imported (top level, not under ``TYPE_CHECKING``) is an edge from its part to
the imported part; the root ``lightning_resilience/__init__.py`` (the public API, which imports everything) is not
a part. Engines must not depend on the layers above them: the layering is asserted too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_resilience"
BENCHMARKS = PACKAGE.parent / "benchmarks"
MAX_LINES = 450
ENGINES = {"checkpoint", "straggler", "sdc", "ft", "sim", "rollback", "step"}
FRAMEWORK_FREE = ENGINES | {
    "collective",
    "deadline",
    "rank_tree",
    "policy",
    "exit_codes",
    "launch",
    "report",
    "attribution",
    "rundir",
}
"""Parts that never import Lightning, not even inside a function: only ``lightning/`` and ``integrations/`` do."""
ABOVE_ENGINES = {"lightning", "integrations", "cli", "config", "launch", "report", "testing"}
LIGHTNING_PACKAGES = {"lightning", "pytorch_lightning", "lightning_fabric"}


def _parts() -> set[str]:
    return {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()} - {
        "__init__",
        "__pycache__",
        "configs",
        "recipes",
    }


def _part_of(module: str, parts: set[str]) -> str | None:
    pieces = module.split(".")
    if pieces[0] != "lightning_resilience" or len(pieces) < 2:
        return None
    return pieces[1] if pieces[1] in parts else None


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports executed at import time: module level, including inside ``try``/``if`` but not ``TYPE_CHECKING``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return found


def _edges() -> dict[str, set[str]]:
    parts = _parts()
    edges: dict[str, set[str]] = {part: set() for part in parts}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts == ("__init__.py",):
            continue
        source = rel.parts[0].removesuffix(".py")
        if source not in parts:
            continue
        for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.module == "lightning_resilience":  # from lightning_resilience import collective
                targets = [f"lightning_resilience.{alias.name}" for alias in node.names]
            else:
                targets = [node.module or ""]
            for target in targets:
                part = _part_of(target, parts)
                assert part is not None or not target.startswith("lightning_resilience"), (
                    f"{rel}: imports {target}, the public API root: import the part that defines it instead"
                )
                if part is not None and part != source:
                    edges[source].add(part)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = walk(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = walk(node)
            if found:
                return found
    return None


def test_no_import_cycle_between_parts() -> None:
    edges = _edges()
    assert {"checkpoint", "collective", "config", "sim"} <= set(edges)  # the walk sees the package
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_engines_do_not_import_the_layers_above_them() -> None:
    edges = _edges()
    wrong = {engine: sorted(edges[engine] & ABOVE_ENGINES) for engine in ENGINES if edges[engine] & ABOVE_ENGINES}
    assert not wrong, f"engines importing adapters, the CLI or the config registry: {wrong}"


def test_the_walk_finds_a_cycle_when_there_is_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("root", [PACKAGE, BENCHMARKS], ids=["package", "benchmarks"])
def test_no_module_over_the_size_limit(root: Path) -> None:
    """The package's modules and the benchmarks' (whose figures the README publishes) alike."""
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them along their seams): {over}"


def _framework_free_files() -> list[Path]:
    files = []
    for part in sorted(FRAMEWORK_FREE):
        path = PACKAGE / part
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")])
    return files


def test_engines_import_no_lightning_anywhere() -> None:
    files = _framework_free_files()
    assert PACKAGE / "checkpoint" / "manager.py" in files and PACKAGE / "collective.py" in files
    wrong = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            wrong += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.split(".")[0] in LIGHTNING_PACKAGES]
    assert not wrong, f"framework-free parts importing Lightning (move it to lightning/): {wrong}"


CALLBACKS = PACKAGE / "lightning" / "callbacks"
ROLES = {"checkpoint", "sdc", "straggler", "fault_tolerance", "policy"}


def test_callbacks_never_import_one_another() -> None:
    """Each callback is an adapter over its own engine: what it needs of another member comes through the suite's
    small protocols (``lightning/_members.py``), never by importing that callback, not even inside a function."""
    mine = {p.stem for p in CALLBACKS.glob("*.py")} - {"__init__"}
    assert {"tiered_checkpoint", "sdc", "straggler", "fault_tolerance"} <= mine
    wrong = []
    for path in sorted(p for p in CALLBACKS.glob("*.py") if p.name != "__init__.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                pieces = name.split(".")
                ours = pieces[:3] == ["lightning_resilience", "lightning", "callbacks"] and len(pieces) > 3
                if ours and pieces[3] in mine and pieces[3] != path.stem:
                    wrong.append(f"{path.name} imports {name}")
    assert not wrong, wrong


def test_no_member_reads_another_through_the_suite() -> None:
    """``suite.checkpoint``, ``suite.sdc``... are the user's handles; members and the rollback use the protocols."""
    files = [*CALLBACKS.glob("*.py"), PACKAGE / "lightning" / "rollback.py", PACKAGE / "lightning" / "_step_path.py"]
    wrong = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ROLES
                and isinstance(node.value, ast.Attribute | ast.Name)
            ):
                owner = node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
                if owner in ("_suite", "suite"):
                    wrong.append(f"{path.name}:{node.lineno}: {owner}.{node.attr}")
    assert not wrong, wrong
