"""The source's shape, checked from its syntax trees: layers that point one way (no import
circle), functions a reader can hold at once, and no engine's names outside its adapter."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ENGINE_DIRS = (SRC / "bunkhouse" / "engines", SRC / "bunkhouse" / "worker" / "engines")
MAX_FUNCTION_LINES = 60

LLAMACPP_NAMES = re.compile(r"\b(id_slot|cache_n|prompt_n|predicted_n|n_ctx)\b|cache_ram|^/slots")
"""llama.cpp's request fields, timings and internal routes (its server's ``/slots``)."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The project modules an import statement loads (a name imported from a package is the
    package's ``__init__`` unless it is a module of its own)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name in MODULES)
        return
    base = node.module or ""
    if node.level:  # relative: from the module's package
        package = module.split(".")
        if MODULES[module].name != "__init__.py":
            package = package[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    for alias in node.names:
        full = f"{base}.{alias.name}"
        if full in MODULES:
            yield full
        elif base in MODULES:
            yield base


def import_graph() -> dict[str, set[str]]:
    """Each module's imports of other project modules, wherever they stand (under
    ``if TYPE_CHECKING:`` and inside functions too); a module's import of a package it is
    inside of is left out (Python has begun loading it already)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges.update(t for t in _imported(module, node)
                             if t != module and not module.startswith(t + "."))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_the_source() -> None:
    graph = import_graph()
    assert len(graph) > 50 and graph["bunkhouse.front.app"]  # the walk found the source
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle_of_types() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_function_over_60_lines() -> None:
    long = [f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)"
            for path in MODULES.values()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and (lines := (node.end_lineno or node.lineno) - node.lineno + 1)
            > MAX_FUNCTION_LINES]
    assert long == []


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            ids.add(id(body[0].value))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            ids.add(id(node.value))  # an attribute's docstring, after its assignment
    return ids


def code_words(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every name and string the code uses (not its comments and docstrings), with its line."""
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.value.lineno, node.arg
        elif isinstance(node, ast.arg | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.lineno, node.arg if isinstance(node, ast.arg) else node.name


@pytest.mark.parametrize("path", [p for p in MODULES.values()
                                  if not any(d in p.parents for d in ENGINE_DIRS)],
                         ids=lambda p: str(p.relative_to(SRC)))
def test_no_llamacpp_field_or_route_outside_its_adapter(path: Path) -> None:
    found = [f"{path.relative_to(SRC)}:{line}: {word!r}"
             for line, word in code_words(ast.parse(path.read_text()))
             if LLAMACPP_NAMES.search(word)]
    assert found == []


def test_the_name_check_sees_code_and_not_docstrings() -> None:
    tree = ast.parse('"""id_slot in a docstring"""\n'
                     'def f(n_ctx):\n    """cache_n here too"""\n'
                     '    return {"prompt_n": x.predicted_n, "/slots/0": 1}\n')
    words = [w for _, w in code_words(tree) if LLAMACPP_NAMES.search(w)]
    assert sorted(words) == ["/slots/0", "n_ctx", "predicted_n", "prompt_n"]
