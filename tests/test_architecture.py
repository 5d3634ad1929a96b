"""The layering holds: no two packages of shardkit import each other, directly or around a circle.

The import graph is read from the source with ``ast`` (module-level imports, imports inside functions and
``TYPE_CHECKING`` blocks, and ``importlib.import_module("shardkit...")`` with a literal name) and folded onto
packages: ``shardkit.X``, and one level deeper for ``shardkit.nn.X`` and ``shardkit.checkpoint.X``, the same rule
as ``../shared/tools/arch_check.py --max-package-cycles``. A cycle names its packages and the imports that close
it, so the message says which file to change.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
#: Packages whose sub-packages are layers of their own (folded one level deeper).
DEEP = ("nn", "checkpoint")


class Edge(NamedTuple):
    """One import of a shardkit module by another: where it is written, and what it names."""

    importer: str
    imported: str
    path: str
    line: int


def module_name(path: Path) -> str:
    """``src/shardkit/nn/fsdp/__init__.py`` -> ``shardkit.nn.fsdp``."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_of(module: str) -> str:
    """The layer a module belongs to: ``shardkit.bench``, ``shardkit.nn.fsdp``, ``shardkit.checkpoint.api``."""
    parts = module.split(".")
    depth = 3 if len(parts) > 2 and parts[1] in DEEP else 2
    return ".".join(parts[:depth])


def _absolute(module: str, is_package: bool, level: int, name: str) -> str:
    """The absolute module of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imported_names(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> Iterator[str]:
    if isinstance(node, ast.ImportFrom):
        target = _absolute(module, is_package, node.level, node.module or "")
        for alias in node.names:
            full = f"{target}.{alias.name}"
            yield full if full in modules else target
    elif isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        yield node.args[0].value


def import_edges() -> list[Edge]:
    """Every import of one shardkit module by another, wherever in the file it is written."""
    paths = {module_name(p): p for p in sorted((SRC / "shardkit").rglob("*.py"))}
    modules = set(paths)
    edges = []
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            for imported in _imported_names(node, module, path.name == "__init__.py", modules):
                if imported in modules and imported != module:
                    edges.append(Edge(module, imported, str(path.relative_to(SRC.parent)), node.lineno))
    return edges


def package_cycles(edges: list[Edge], group: Callable[[str], str] = package_of) -> list[list[str]]:
    """Groups of packages (or of whatever ``group`` maps a module to) that reach each other (strongly connected,
    more than one member), each sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        src, dst = group(edge.importer), group(edge.imported)
        graph.setdefault(src, set())
        graph.setdefault(dst, set())
        if src != dst:
            graph[src].add(dst)

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reaches = {pkg: reach(pkg) for pkg in graph}
    cycles, placed = [], set()
    for pkg in sorted(graph):
        if pkg in placed or pkg not in reaches[pkg]:
            continue
        group = sorted({pkg} | {other for other in reaches[pkg] if pkg in reaches[other]})
        placed.update(group)
        cycles.append(group)
    return cycles


def describe(cycle: list[str], edges: list[Edge]) -> str:
    """The packages of a cycle and the imports between them (``file:line importer -> imported``)."""
    members = set(cycle)
    lines = [" <-> ".join(cycle)]
    for edge in sorted(set(edges), key=lambda e: (e.path, e.line, e.imported)):
        src, dst = package_of(edge.importer), package_of(edge.imported)
        if src != dst and src in members and dst in members:
            lines.append(f"    {edge.path}:{edge.line}  {src} -> {dst} ({edge.imported})")
    return "\n".join(lines)


def test_no_package_imports_another_that_imports_it_back() -> None:
    edges = import_edges()
    cycles = package_cycles(edges)
    assert not cycles, (
        f"{len(cycles)} package cycle(s); move the code to the layer that owns it (a lazy import is still an "
        "edge):\n" + "\n".join(describe(cycle, edges) for cycle in cycles)
    )


def test_no_module_imports_another_that_imports_it_back() -> None:
    edges = import_edges()
    cycles = package_cycles(edges, group=lambda module: module)
    assert not cycles, (
        f"{len(cycles)} module cycle(s), type-checking imports included; move what both need to a module of its "
        "own:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"a": ["b"], "b": ["c"], "c": []}, []),
        ({"a": ["b"], "b": ["a"], "c": ["a"]}, [["shardkit.a", "shardkit.b"]]),
        ({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["d"]}, [["shardkit.a", "shardkit.b", "shardkit.c"]]),
    ],
)
def test_the_cycle_finder_finds_what_is_there(source: dict[str, list[str]], expected: list[list[str]]) -> None:
    edges = [Edge(f"shardkit.{a}.m", f"shardkit.{b}.m", "x.py", 1) for a, bs in source.items() for b in bs]
    assert package_cycles(edges) == expected


def test_a_lazy_import_back_would_close_a_cycle() -> None:
    edges = import_edges()
    # nn.fsdp's helpers import nn.wrap at module level; a lazy import back from nn.wrap would be a cycle.
    assert any(
        package_of(e.importer) == "shardkit.nn.fsdp" and package_of(e.imported) == "shardkit.nn.wrap" for e in edges
    )
    lazy = Edge("shardkit.nn.wrap.context", "shardkit.nn.fsdp", "src/shardkit/nn/wrap/context.py", 1)
    cycles = package_cycles([*edges, lazy])
    assert ["shardkit.nn.fsdp", "shardkit.nn.wrap"] in cycles
    assert "src/shardkit/nn/wrap/context.py:1" in describe(["shardkit.nn.fsdp", "shardkit.nn.wrap"], [*edges, lazy])


def test_function_local_imports_are_seen() -> None:
    # cli.py imports the benchmarks inside a function (start-up cost); the graph must still hold that edge.
    edges = import_edges()
    assert any(e.importer == "shardkit.cli" and package_of(e.imported) == "shardkit.bench" for e in edges)


#: Why a shardkit module may be imported inside a function instead of at the top of the file; the comment on the
#: line above the import (or on it) must say which.
LAZY_REASONS = ("start-up cost", "optional dependency", "imported in the check")
#: Files with function-local imports not yet justified, each being reworked on another branch of issue 25 (item 3:
#: compatibility paths; item 4: one read model of FSDP state). Remove an entry when its rework lands.
NOT_YET_JUSTIFIED: set[str] = set()


def unjustified_local_imports() -> dict[str, list[int]]:
    """``{file: [line, ...]}`` of imports of shardkit modules inside functions with no comment giving a reason."""
    found: dict[str, list[int]] = {}
    for path in sorted((SRC / "shardkit").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not _is_shardkit_import(node):
                    continue
                assert isinstance(node, (ast.Import, ast.ImportFrom))
                above = lines[node.lineno - 2 : node.lineno]
                # a run of imports shares the comment above its first line
                start = node.lineno - 1
                while start > 0 and lines[start - 1].lstrip().startswith(("from ", "import ")):
                    start -= 1
                context = " ".join([*above, lines[start - 1] if start > 0 else ""])
                if not any(reason in context for reason in LAZY_REASONS):
                    found.setdefault(str(path.relative_to(SRC.parent)), []).append(node.lineno)
    return {name: sorted(set(lines_)) for name, lines_ in found.items()}


def _is_shardkit_import(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").startswith("shardkit")
    return isinstance(node, ast.Import) and any(alias.name.startswith("shardkit") for alias in node.names)


def test_function_local_imports_say_why() -> None:
    found = unjustified_local_imports()
    unexplained = {name: lines for name, lines in found.items() if name not in NOT_YET_JUSTIFIED}
    assert not unexplained, (
        "import these at the top of the file, or say on the line above which of "
        f"{', '.join(LAZY_REASONS)} keeps them inside the function:\n"
        + "\n".join(f"    {name}:{','.join(map(str, lines))}" for name, lines in unexplained.items())
    )
    stale = sorted(NOT_YET_JUSTIFIED - set(found))
    assert not stale, f"remove from NOT_YET_JUSTIFIED (no unexplained lazy import left): {stale}"
