"""The optimizer side files: per parameter name, its group's settings and its non-tensor state, as JSON.

Values are plain JSON plus two tagged forms: a tuple (``{"__tuple__": [...]}``, Adam's ``betas``) and a one-element
tensor (``{"__tensor__": value, "dtype": "float32"}``, e.g. a tensor learning rate). Anything else is refused when
saving, naming the setting, so nothing is ever pickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint.errors import CheckpointError, CorruptCheckpointError
from shardkit.checkpoint.files import write_json_atomic
from shardkit.checkpoint.universal.layout import SIDE_DIR, side_file


def encode(value: Any, where: str) -> Any:
    """``value`` as JSON data; :class:`CheckpointError` naming ``where`` if it has no JSON form here."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, where) for v in value]}
    if isinstance(value, list):
        return [encode(v, where) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: encode(v, where) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {
            "__tensor__": value.item(),
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
        }
    raise CheckpointError(
        f"optimizer setting or state {where} is a {type(value).__name__}, which a checkpoint cannot store without "
        "pickling; use numbers, strings, tuples, lists or one-element tensors"
    )


def decode(value: Any) -> Any:
    """The Python value :func:`encode` stored."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        if "__tensor__" in value:
            dtype = getattr(torch, str(value.get("dtype")), None)
            if not isinstance(dtype, torch.dtype):
                raise CorruptCheckpointError(f"optimizer side file names an unknown dtype {value.get('dtype')!r}")
            return torch.tensor(value["__tensor__"], dtype=dtype).reshape(value.get("shape", []))
        return {k: decode(v) for k, v in value.items()}
    return value


@dataclass
class SideState:
    """Per parameter name: its group's settings and its non-tensor state (encoded)."""

    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    state: dict[str, dict[str, Any]] = field(default_factory=dict)

    def write(self, directory: Path, rank: int) -> None:
        """Write this rank's side file."""
        path = side_file(directory, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"groups": self.groups, "state": self.state})

    def merge(self, other: SideState) -> None:
        """Add ``other``'s entries (ranks holding the same parameter wrote the same values)."""
        self.groups.update(other.groups)
        for fqn, values in other.state.items():
            self.state.setdefault(fqn, {}).update(values)


def read_all(directory: Path) -> SideState:
    """The union of every rank's side file (empty when the checkpoint holds no optimizer)."""
    union = SideState()
    folder = directory / SIDE_DIR
    if not folder.is_dir():
        return union
    for path in sorted(folder.glob("rank_*.json")):
        try:
            obj = json.loads(path.read_text())
            part = SideState(groups=dict(obj["groups"]), state=dict(obj["state"]))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CorruptCheckpointError(
                f"{path} cannot be read ({err!r}); the optimizer side file is damaged"
            ) from None
        union.merge(part)
    return union
