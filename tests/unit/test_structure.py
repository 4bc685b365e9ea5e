"""The house's shape: layers import only downward, no import circles, no oversized module,
and the admission gate's state is written only inside its own module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "omnistage"
# Lower layers know nothing of higher ones (a module may import its own layer or below).
LAYERS = {
    "errors": 0,
    "config": 0,
    "logs": 0,
    "rl": 0,
    "memory": 1,
    "models": 2,
    "pipelines": 2,
    "stage": 3,
    "engine": 4,
    "entrypoints": 5,
    "bench": 6,
    "cli": 6,
}
MAX_LINES = 430


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported(path: Path) -> set[str]:
    """Every omnistage module ``path`` imports, at the top or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.startswith("omnistage")}


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_no_import_runs_upward():
    upward = []
    for name, path in modules().items():
        own = layer(name)
        if own is None:
            continue
        for target in imported(path):
            theirs = layer(target)
            if theirs is not None and theirs > own:
                upward.append(f"{name} -> {target}")
    assert not upward, upward


def test_no_import_circle():
    known = modules()
    graph = {
        name: {t for t in imported(path) if t in known and t != name}
        for name, path in known.items()
    }
    # Importing a package runs its __init__: an edge to a.b.c is an edge to a.b too.
    for targets in graph.values():
        for target in list(targets):
            parts = target.split(".")
            targets.update(".".join(parts[:i]) for i in range(2, len(parts)))
    seen: dict[str, int] = {}
    circles = []

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                circles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in seen:
                visit(nxt, [*stack, nxt])
        seen[node] = 2

    for name in graph:
        if name not in seen:
            visit(name, [name])
    # A package's __init__ re-exporting its own modules is not a circle of meaning.
    circles = [c for c in circles if not all(m.startswith(c[0] + ".") for m in c[1:-1])]
    assert not circles, circles


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_is_oversized(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it"


def _writes_gate_state(node: ast.AST) -> bool:
    """``<...>.gate.stages[...].<field> = ...`` (or augmented)."""
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    for target in targets:
        if (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Subscript)
            and isinstance(target.value.value, ast.Attribute)
            and target.value.value.attr == "stages"
        ):
            return True
    return False


def test_only_the_admission_module_writes_the_gate_state():
    writers = []
    for name, path in modules().items():
        if name == "omnistage.engine.admission":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AugAssign) and _writes_gate_state(node):
                writers.append(f"{name}:{node.lineno}")
    assert not writers, writers


def test_the_control_vocabulary_is_defined_once():
    """The HTTP models' literals (pydantic needs them spelled out) equal the one definition."""
    from typing import get_args

    from omnistage.entrypoints.serve.omni_control import protocol
    from omnistage.stage import sleep_args

    assert get_args(protocol.SleepMode) == sleep_args.SLEEP_MODES
    assert get_args(protocol.MemoryTag) == sleep_args.MEMORY_TAGS
    assert frozenset(sleep_args.MEMORY_TAGS) == protocol.ALL_MEMORY_TAGS
    level = protocol.OmniSleepRequest.model_fields["level"]
    assert level.default == sleep_args.DEFAULT_SLEEP_LEVEL
