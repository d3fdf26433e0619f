"""The package's layers: imports flow downward only, ops never import components, and the
module-level imports form no cycle.

Every module of ``mila_py`` is parsed with ``ast`` (nothing is imported), and every import it
makes of a ``mila_py`` module is collected: at module level, inside functions and methods, and
under ``if TYPE_CHECKING:``. ``from package import name`` counts as an import of
``package.name`` where that is a module, else of ``package``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mila_py"

#: The layers, bottom first: a module may import modules of its own rank or below, never above.
#: A module belongs to the longest prefix that matches its dotted name (a package prefix covers
#: every module under it, present or added later). The op interface (``Operation`` and the
#: registry) ranks with the core: ``Component`` creates its ops through the registry and
#: counts their state through ``Operation``; the op implementations (``ops.cpu``,
#: ``ops.cuda``) sit above RoPE's math, whose tables they read. ``serialization`` is core:
#: ``Component.save``/``load`` call it.
RANKS: dict[str, tuple[int, str]] = {
    "mila_py._lazy": (0, "devices"),  # the packages' lazy submodule attributes
    "mila_py.devices": (0, "devices"),
    "mila_py.build_context": (1, "core"),
    "mila_py.precision": (1, "core"),
    "mila_py.memory": (1, "core"),
    "mila_py.files": (1, "core"),
    "mila_py.run_lock": (1, "core"),
    "mila_py.init": (1, "core"),
    "mila_py.serialization": (1, "core"),
    "mila_py.component": (1, "core"),
    "mila_py.composite": (1, "core"),
    "mila_py.ops": (1, "core"),  # the package itself (empty)
    "mila_py.ops.operation": (1, "core"),
    "mila_py.ops.registry": (1, "core"),
    "mila_py.rope": (2, "rope"),
    "mila_py.ops.cpu": (3, "ops"),
    "mila_py.ops.cuda": (3, "ops"),
    "mila_py.components": (4, "components"),
    "mila_py.models": (5, "models"),
    "mila_py.interop": (6, "interop"),
    "mila_py.optim": (7, "top"),
    "mila_py.train": (7, "top"),
    "mila_py.data": (7, "top"),
    "mila_py.distributed": (7, "top"),
    "mila_py.cli": (7, "top"),
    "mila_py.serve": (7, "top"),
    "mila_py.__main__": (7, "top"),
    "mila_py": (7, "top"),  # the package's __init__: public re-exports only
}

#: The imports allowed to point up, as (importer, imported, function that imports): each is
#: made inside that function, so that it runs at call time and never at import time.
ALLOWED_UPWARD: dict[tuple[str, str, str], str] = {
    ("mila_py.models.llama.network", "mila_py.interop.hf", "Llama.from_pretrained"): (
        "Hugging Face users expect Llama.from_pretrained; the reading lives in interop"
    ),
    ("mila_py.serialization", "mila_py", "mila_py_version"): (
        "reads the package's __version__; the package is imported before any of its modules"
    ),
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    function: str | None  # qualified name of the enclosing function; None at module level
    type_only: bool  # under ``if TYPE_CHECKING:``


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {
    _module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts
}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module of a ``from ... import`` (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_of(name: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def add(target: str, node: ast.stmt, function: str | None, type_only: bool) -> None:
        found_here = Import(name, target, node.lineno, function, type_only)
        if (target == "mila_py" or target.startswith("mila_py.")) and found_here not in found:
            found.append(found_here)

    def visit(node: ast.AST, scope: list[str], function: str | None, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, function, type_only)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in MODULES else base, node, function, type_only)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inner = [*scope, node.name]
            for child in node.body:
                visit(child, inner, ".".join(inner), type_only)
            return
        elif isinstance(node, ast.ClassDef):
            inner = [*scope, node.name]
            for child in node.body:
                visit(child, inner, function, type_only)
            return
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, scope, function, True)
            for child in node.orelse:
                visit(child, scope, function, type_only)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, scope, function, type_only)

    visit(tree, [], None, False)
    return found


IMPORTS: list[Import] = [i for name, path in MODULES.items() for i in _imports_of(name, path)]


def rank_of(module: str) -> tuple[int, str]:
    """The rank and layer of ``module``: its longest prefix in :data:`RANKS`."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in RANKS:
            return RANKS[prefix]
    raise KeyError(module)


def _where(i: Import) -> str:
    inside = f" in {i.function}()" if i.function else ""
    return f"{MODULES[i.importer].relative_to(ROOT)}:{i.line}{inside} imports {i.imported}"


def test_the_package_is_parsed_with_its_function_level_imports() -> None:
    assert {"mila_py.component", "mila_py.ops.cpu.rope", "mila_py.models.llama.network"} <= set(
        MODULES
    )
    deferred = [i for i in IMPORTS if i.function == "Llama.from_pretrained"]
    assert [i.imported for i in deferred if i.imported.startswith("mila_py.interop")] == [
        "mila_py.interop.hf"
    ]
    assert any(i.function is None for i in IMPORTS)


def test_every_module_has_a_layer() -> None:
    missing = []
    for module in MODULES:
        try:
            rank_of(module)
        except KeyError:
            missing.append(module)
    assert not missing, f"modules outside the layer table of {__name__}: {missing}"


def test_imports_flow_downward_only() -> None:
    """A module imports its own layer or lower ones; the allowed exceptions are deferred."""
    upward, used = [], set()
    for i in IMPORTS:
        if i.imported not in MODULES:
            upward.append(f"{_where(i)}, which does not exist")
            continue
        (low, low_layer), (high, high_layer) = rank_of(i.importer), rank_of(i.imported)
        if high <= low:
            continue
        key = (i.importer, i.imported, i.function or "")
        if key in ALLOWED_UPWARD:
            used.add(key)
            continue
        upward.append(f"{_where(i)} ({low_layer} -> {high_layer})")
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)
    assert used == set(ALLOWED_UPWARD), (
        f"stale ALLOWED_UPWARD entries: {set(ALLOWED_UPWARD) - used}"
    )


@pytest.mark.parametrize("above", ["mila_py.components", "mila_py.models", "mila_py.interop"])
def test_ops_import_no_component_model_or_interop(above: str) -> None:
    wrong = [
        _where(i)
        for i in IMPORTS
        if i.importer.startswith("mila_py.ops")
        and (i.imported == above or i.imported.startswith(above + "."))
    ]
    assert not wrong, "\n".join(wrong)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_module_level_imports_have_no_cycle() -> None:
    """What runs at import time: module-level imports, not those under TYPE_CHECKING or inside
    functions (a deferred import, such as Llama.from_pretrained's, runs at call time)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for i in IMPORTS:
        if i.function is None and not i.type_only and i.imported != i.importer:
            graph[i.importer].add(i.imported)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
