"""COMPATIBILITY.md's list of smp v1 public names matches ``dir(smp)`` both ways: every name listed as present
exists, every name listed as missing does not, and every public name of the module is listed."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import pytest

import shardkit.modelparallel as smp
from shardkit.modelparallel.tensor_parallel import TensorParallelismNotSupported

_ROW = re.compile(r"^\| `smp\.([A-Za-z_][A-Za-z0-9_.]*)` \| (same|differs|refuses|missing|added) \|")
STATUSES = {"same", "differs", "refuses", "missing", "added"}


def _listed() -> dict[str, str]:
    text = (Path(__file__).resolve().parents[2] / "COMPATIBILITY.md").read_text()
    section = text.split("## smp (`import shardkit.modelparallel as smp`)", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = _ROW.match(line)
        if match:
            assert match.group(1) not in rows, f"smp.{match.group(1)} is listed twice"
            rows[match.group(1)] = match.group(2)
    return rows


def _lookup(dotted: str) -> Any:
    obj: Any = smp
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _public_names() -> set[str]:
    """Public names of the module: not private, not one of its own implementation submodules."""
    names = set()
    for name in dir(smp):
        if name.startswith("_"):
            continue
        value = getattr(smp, name)
        if isinstance(value, types.ModuleType) and name not in smp.__all__:
            continue  # e.g. smp.state, smp.comm: where the names live, not names scripts use
        names.add(name)
    return names | {"__version__"}


def test_every_listed_name_is_as_listed() -> None:
    rows = _listed()
    assert len(rows) > 60, "the table of smp names was not found"
    wrong = []
    for name, status in rows.items():
        try:
            _lookup(name)
            exists = True
        except AttributeError:
            exists = False
        if exists == (status == "missing"):
            wrong.append(f"smp.{name} is listed as {status} but {'exists' if exists else 'does not exist'}")
    assert not wrong, "\n".join(wrong)


def test_every_public_name_is_listed() -> None:
    listed = _listed()
    unlisted = sorted(_public_names() - set(listed))
    assert not unlisted, f"public smp names missing from COMPATIBILITY.md's smp table: {unlisted}"
    assert set(smp.__all__) <= set(listed)


def test_refusing_names_raise_the_tensor_parallelism_error() -> None:
    refusing = [name for name, status in _listed().items() if status == "refuses"]
    for name in refusing:
        with pytest.raises(TensorParallelismNotSupported, match="not built in shardkit yet"):
            _lookup(name)(16, 16)
