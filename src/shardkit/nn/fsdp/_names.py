"""Names as the unwrapped model spells them: a wrapper level adds no ``module.`` segment to paths."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

from torch import nn

from shardkit.nn.checkpoint.wrapper import adds_no_name


def clean_named_modules(
    root: nn.Module, is_unit: Callable[[nn.Module], bool], prefix: str = ""
) -> Iterator[tuple[str, nn.Module]]:
    """Pre-order ``(path, module)``, each module once; the child ``module`` of a unit shares its parent's path
    (so does the module inside a :class:`~shardkit.nn.checkpoint.CheckpointWrapper`)."""
    seen: set[int] = set()

    def visit(module: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
        if id(module) in seen:
            return
        seen.add(id(module))
        yield path, module
        for name, child in module._modules.items():
            if child is None:
                continue
            if (is_unit(module) and name == "module") or adds_no_name(module, name):
                yield from visit(child, path)
            else:
                yield from visit(child, f"{path}.{name}" if path else name)

    yield from visit(root, prefix)


def clean_members(
    root: nn.Module, is_unit: Callable[[nn.Module], bool], kind: str, prefix: str, remove_duplicate: bool
) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for ``kind`` = ``"_parameters"`` or ``"_buffers"`` under clean names."""
    seen: set[int] = set()
    for path, module in clean_named_modules(root, is_unit, prefix):
        for name, value in getattr(module, kind).items():
            if value is None or (remove_duplicate and id(value) in seen):
                continue
            seen.add(id(value))
            yield (f"{path}.{name}" if path else name), value
