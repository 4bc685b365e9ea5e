"""The house's shape: layers import only downward, no import circles, no oversized module;
the admission gate's state is written only inside its own module; the engine, the stages and
the HTTP layer import no model family and name no model; stage kinds are listed and branched
on only in the kinds map and their own packages; control calls are dispatched by type."""

from __future__ import annotations

import ast
import re
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
    "stage": 3,
    "pipelines": 4,
    "engine": 5,
    "entrypoints": 6,
    "bench": 7,
    "cli": 7,
}
MAX_LINES = 430
MAX_DOCSTRING_LINES = 30


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of the import nodes under ``if TYPE_CHECKING:`` (never run)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            found.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return found


def imported(path: Path, *, run_only: bool = False) -> set[str]:
    """Every omnistage module ``path`` imports, at the top or inside functions; with
    ``run_only``, not those imported for the type checker alone (``if TYPE_CHECKING:``)."""
    names = set()
    tree = ast.parse(path.read_text())
    skip = _type_only(tree) if run_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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
    """Imports for the type checker alone do not count: they never run (the protocols of
    ``omnistage.models.interfaces`` name the configs whose readers use the registry), and
    ``test_no_import_runs_upward`` still holds them to the layers."""
    known = modules()
    graph = {
        name: {t for t in imported(path, run_only=True) if t in known and t != name}
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


def test_no_module_docstring_is_a_design_essay():
    """A module docstring says what the module does and points to docs/ for the why."""
    long = {}
    for name, path in modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if doc.count("\n") + 1 > MAX_DOCSTRING_LINES:
            long[name] = doc.count("\n") + 1
    assert not long, f"move the design prose to docs/: {long}"


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
    """Modes, tags and levels are spelled only in the vocabulary module: the HTTP models, the
    engine client and the stages check them with its functions (one error each)."""
    from omnistage.entrypoints.serve.omni_control import protocol
    from omnistage.stage import vocabulary

    level = protocol.OmniSleepRequest.model_fields["level"]
    assert level.default == vocabulary.DEFAULT_SLEEP_LEVEL
    spelled = re.compile(r"""["'](abort|wait|keep)["'],\s*["'](abort|wait|keep)["']""")
    tags = re.compile(r"""["'](weights|kv_cache)["'],\s*["'](weights|kv_cache)["']""")
    lists = [
        name
        for name, path in modules().items()
        if name != "omnistage.stage.vocabulary"
        and (spelled.search(path.read_text()) or tags.search(path.read_text()))
    ]
    assert not lists, f"modes or tags listed outside omnistage.stage.vocabulary: {lists}"


# Layers that must know no model: they reach model knowledge through registries only.
MODEL_BLIND = ("omnistage.engine", "omnistage.entrypoints", "omnistage.stage")
# (Stage roles such as "thinker" or "talker" are names pipelines give stages, not models.)
MODEL_NAMES = re.compile(
    r"qwen|llama|pixart|flux|stable.?diffusion|sd3|token2wav|bigvgan|\bwan\b", re.IGNORECASE
)


def model_family_modules() -> set[str]:
    """Every module of a model family (``omnistage.models.<family>``), by the registry."""
    from omnistage.models import registry

    return {name for name in modules() if registry.is_family_module(name)}


def test_the_engine_the_stages_and_the_http_layer_import_no_model_family():
    families = model_family_modules()
    assert families, "the registry names no family module"
    found = [
        f"{name} -> {target}"
        for name, path in modules().items()
        if name.startswith(MODEL_BLIND)
        for target in imported(path)
        if target in families or any(target.startswith(f + ".") for f in families)
    ]
    assert not found, found


def test_the_engine_the_stages_and_the_http_layer_name_no_model():
    named = [
        f"{name}:{lineno}: {line.strip()}"
        for name, path in modules().items()
        if name.startswith(MODEL_BLIND)
        for lineno, line in enumerate(path.read_text().splitlines(), 1)
        if MODEL_NAMES.search(line)
    ]
    assert not named, "\n".join(named)


def _kind_literals(tree: ast.AST, kinds: set[str]) -> list[int]:
    """Lines that compare with a kind name, key a mapping by one, pass one as ``kind=`` or
    spell kinds in a ``Literal``: listing or branching on stage kinds."""
    lines = []

    def is_kind(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and node.value in kinds

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for operand in operands:
                elements = (
                    operand.elts
                    if isinstance(operand, ast.Tuple | ast.List | ast.Set)
                    else [operand]
                )
                if any(is_kind(e) for e in elements):
                    lines.append(node.lineno)
        elif isinstance(node, ast.Dict):
            if any(is_kind(k) for k in node.keys) or any(
                isinstance(k, ast.Constant) and k.value == "kind" and is_kind(v)
                for k, v in zip(node.keys, node.values, strict=True)
            ):
                lines.append(node.lineno)
        elif isinstance(node, ast.keyword) and node.arg == "kind" and is_kind(node.value):
            lines.append(node.value.lineno)
        elif (
            isinstance(node, ast.Subscript)
            and "Literal" in ast.unparse(node.value)
            and any(is_kind(n) for n in ast.walk(node.slice))
        ):
            lines.append(node.lineno)
    return lines


def test_stage_kinds_are_named_only_in_the_kinds_map_and_their_packages():
    from omnistage.stage.kinds import STAGE_KINDS

    kinds = set(STAGE_KINDS)
    # the kinds' own options are configuration, which loads below the stages
    homes = (
        "omnistage.stage.kinds",
        "omnistage.config.options",
        *(f"omnistage.stage.{kind}" for kind in kinds),
    )
    found = [
        f"{name}:{line}"
        for name, path in modules().items()
        if not name.startswith(homes)
        for line in _kind_literals(ast.parse(path.read_text()), kinds)
    ]
    assert not found, found


def test_no_call_is_dispatched_by_a_name_looked_up_at_run_time():
    """``getattr(obj, name)(...)`` with a computed name in the engine, the stages or the HTTP
    layer: control operations are typed structs dispatched by type
    (``omnistage.stage.control``), never method names."""
    found = []
    for name, path in modules().items():
        if not name.startswith(MODEL_BLIND):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Call)
                and isinstance(node.func.func, ast.Name)
                and node.func.func.id == "getattr"
                and len(node.func.args) >= 2
                and not isinstance(node.func.args[1], ast.Constant)
            ):
                found.append(f"{name}:{node.lineno}")
    assert not found, found


def test_the_family_seams_are_typed():
    """What the registry hands out is typed (``omnistage.models.interfaces``), never ``Any``:
    a caller gets a ``ModelFamily``, an ``ARFamily``, a ``DiffusionFamily`` or an
    ``InputProcessor`` and the type checker follows it."""
    source = (PACKAGE / "models" / "registry.py").read_text()
    untyped = [
        node.name
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef)
        and node.name in ("family", "ar_family", "family_of", "family_of_folder", "processor")
        and (node.returns is None or ast.unparse(node.returns) in ("Any", "object"))
    ]
    assert not untyped, untyped


def _probes_a_family(node: ast.AST) -> bool:
    """``getattr(<...family...>, "name"...)`` or ``hasattr(<...family...>, "name")``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and "family" in ast.unparse(node.args[0]).lower()
    )


def test_no_family_capability_is_probed_by_name():
    """A family says what it can do by deriving from a capability protocol, and callers ask
    with ``omnistage.models.interfaces``' ``supports_*`` / ``is_*`` helpers, never with
    ``getattr(family, "prompt_processor", None)``."""
    found = [
        f"{name}:{node.lineno}"
        for name, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if _probes_a_family(node)
    ]
    assert not found, found
    probe = ast.parse('getattr(family, "prompt_processor", None)').body[0]
    assert _probes_a_family(probe.value)  # type: ignore[attr-defined]


def test_every_omni_route_lives_in_omni_control():
    """A ``/v1/omni/*`` route is declared in ``entrypoints/serve/omni_control/`` and nowhere
    else (vLLM's names for the same operations are elsewhere, under their own paths)."""
    home = "omnistage.entrypoints.serve.omni_control"
    found = []
    for name, path in modules().items():
        decorators = [
            d
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for d in node.decorator_list
        ]
        for node in decorators:
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "post", "put", "delete", "api_route")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("/v1/omni")
                and not name.startswith(home)
            ):
                found.append(f"{name}:{node.lineno}")
    assert not found, found
