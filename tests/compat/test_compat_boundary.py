"""fairscale's import paths stay at the edge: read from the source, never imported by the core.

Every module listed in :data:`shardkit.compat.COMPAT_PATHS` must exist, say in its first docstring line that it is a
compatibility path, and hold nothing but that docstring, imports from core modules (or from
:mod:`shardkit.compat.fairscale`, the one home of fairscale-only objects) and ``__all__``: one hop from the owning
module, never through another compatibility path. No other module may import a compatibility path or
:mod:`shardkit.compat`, not even inside a function or under ``TYPE_CHECKING``, nor name one in a string
(``importlib.import_module("shardkit.optim.oss")``, ``"shardkit.optim.oss:OSS"``).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import shardkit
from shardkit.compat import COMPAT_PATHS

SRC = Path(shardkit.__file__).parent
MARK = "Compatibility path"


def _module_files() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _module_files()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_compat(name: str) -> bool:
    return name in COMPAT_PATHS or name == "shardkit.compat" or name.startswith("shardkit.compat.")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _references(module: str) -> list[tuple[int, str]]:
    """Every shardkit module ``module`` imports (anywhere in the file) or names in a string, with its line."""
    refs: list[tuple[int, str]] = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            refs += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            refs.append((node.lineno, source))
            # ``from shardkit.nn import data_parallel`` imports a module too
            refs += [(node.lineno, f"{source}.{a.name}") for a in node.names if f"{source}.{a.name}" in MODULES]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            target = node.value.partition(":")[0]
            if target in MODULES:
                refs.append((node.lineno, target))
    return [(line, name) for line, name in refs if name.startswith("shardkit")]


def _docstring_first_line(module: str) -> str:
    return (ast.get_docstring(TREES[module]) or "").split("\n", 1)[0]


def test_the_table_lists_modules_that_exist_and_say_what_they_are() -> None:
    missing = sorted(set(COMPAT_PATHS) - set(MODULES))
    assert not missing, f"COMPAT_PATHS lists modules that do not exist: {missing}"
    unmarked = [name for name in COMPAT_PATHS if not _docstring_first_line(name).startswith(MARK)]
    assert not unmarked, f"these compatibility paths do not say so in their docstring's first line: {unmarked}"


def test_every_module_that_calls_itself_a_compatibility_path_is_in_the_table() -> None:
    unlisted = [n for n in MODULES if _docstring_first_line(n).startswith(MARK) and n not in COMPAT_PATHS]
    assert not unlisted, f"list these in shardkit.compat.COMPAT_PATHS (or drop the docstring's claim): {unlisted}"


def test_no_core_module_imports_a_compatibility_path_or_the_compat_package() -> None:
    core = [name for name in MODULES if not _is_compat(name)]
    assert "shardkit.nn.fsdp.api" in core and "shardkit.optim" in core  # the split itself is not empty
    reaches = [
        f"{MODULES[name].relative_to(SRC.parent)}:{line} -> {target}"
        for name in core
        for line, target in _references(name)
        if _is_compat(target)
    ]
    assert not reaches, "core modules reach compatibility paths:\n" + "\n".join(reaches)


@pytest.mark.parametrize("name", sorted(COMPAT_PATHS))
def test_a_compatibility_path_only_reexports_from_one_hop_away(name: str) -> None:
    tree = TREES[name]
    body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
    imported: list[str] = []
    for node in body:
        if isinstance(node, ast.ImportFrom):
            source = _resolve(name, node)
            assert source.startswith("shardkit."), f"{name} imports {source}: a compatibility path only re-exports"
            assert source not in COMPAT_PATHS, f"{name} re-exports from {source}, another compatibility path"
            imported += [alias.asname or alias.name for alias in node.names]
        elif isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            exported = ast.literal_eval(node.value)
            assert sorted(exported) == sorted(imported), f"{name}: __all__ must list exactly what it imports"
        else:
            pytest.fail(f"{name}:{node.lineno} holds code; a compatibility path only imports and lists __all__")


@pytest.mark.parametrize("name", sorted(COMPAT_PATHS))
def test_a_compatibility_path_imports_and_exports_its_names(name: str) -> None:
    module = importlib.import_module(name)
    for attr in getattr(module, "__all__", []):
        assert getattr(module, attr) is not None, f"{name}.{attr}"


def test_no_module_replaces_its_own_class() -> None:
    """``sys.modules[__name__].__class__ = ...`` makes a module something else than it reads as; fairscale's names
    that need a callable (``shardkit.nn.wrap``) are bound as plain attributes instead."""
    swaps = [
        f"{MODULES[name].relative_to(SRC.parent)}:{node.lineno}"
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
        and target.attr == "__class__"
        and "sys.modules" in ast.unparse(target.value)
    ]
    assert not swaps, f"modules replacing a module's class: {swaps}"
