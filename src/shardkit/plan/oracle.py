"""Values for code that reads data out of meta tensors.

Meta tensors carry shapes and no data, so ``.item()``, ``.tolist()`` or a copy to the CPU fail on them. A strategy
reads data for two reasons: bookkeeping that travelled through a meta tensor (DDP's parameter-shape verification
writes shapes to a CPU tensor, moves it to the parameters' device, all-gathers it and reads it back) and numeric
checks on the values (a gradient norm, "was this parameter used" flags). :class:`MetaData` answers both: data
copied from the CPU onto a meta tensor is remembered beside it (and follows it through copies and collectives,
which copy meta onto meta), and anything else read from a meta tensor reads as ones: finite, non-zero, "used", the
value under which every strategy takes its ordinary path.

Only the planner uses this; it is a planning approximation for the *values* of meta tensors, never for sizes, so
memory and traffic stay exact.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

import torch

aten = torch.ops.aten
# The two aten operators that read a tensor's data (``.item()`` and a copy to another device), matched by their
# registered names: ``OpOverload.name()`` is the public handle on an operator whose Python name is underscored.
_SCALAR_READ = "aten::_local_scalar_dense"
COPY_TO = "aten::_to_copy"


class MetaData:
    """CPU copies of the data that reached meta tensors, keyed by storage (weakly)."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref[torch.UntypedStorage], torch.Tensor]] = {}

    def _remember(self, meta: torch.Tensor, cpu: torch.Tensor) -> None:
        storage = meta.untyped_storage()
        key = id(storage)
        self._known[key] = (weakref.ref(storage, functools.partial(self._drop, key)), cpu.detach().clone())

    def _drop(self, key: int, _ref: object) -> None:
        self._known.pop(key, None)

    def _recall(self, meta: torch.Tensor) -> Optional[torch.Tensor]:
        entry = self._known.get(id(meta.untyped_storage()))
        if entry is None or entry[0]() is None:
            return None
        data = entry[1]
        if data.shape != meta.shape:
            return data.reshape(-1)[: meta.numel()].reshape(meta.shape) if data.numel() >= meta.numel() else None
        return data

    def _read(self, meta: torch.Tensor, dtype: torch.dtype, device: Any) -> torch.Tensor:
        known = self._recall(meta)
        if known is not None:
            return known.to(device=device, dtype=dtype)
        return torch.ones(meta.shape, dtype=dtype, device=device)

    def intercept(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """``(True, result)`` when this object answers ``func`` (a meta data read or write), else ``(False, None)``."""
        if func.name() == _SCALAR_READ and _is_meta(args[0]):
            value = self._read(args[0], args[0].dtype, "cpu")
            return True, value.item()
        if func.name() == COPY_TO and isinstance(args[0], torch.Tensor):
            src = args[0]
            target = kwargs.get("device")
            dst_meta = target is not None and torch.device(target).type == "meta"
            if src.device.type == "meta" and target is not None and not dst_meta:
                rest = {k: v for k, v in kwargs.items() if k not in ("device", "dtype", "layout", "non_blocking")}
                if rest.get("memory_format") is None:
                    return True, self._read(src, kwargs.get("dtype") or src.dtype, target)
            if src.device.type != "meta" and dst_meta:
                out = src.new_empty(src.shape, device="meta", dtype=kwargs.get("dtype") or src.dtype)
                self._remember(out, src)
                return True, out
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if _is_meta(dst) and isinstance(src, torch.Tensor):
                data = self._recall(src) if _is_meta(src) else src
                if data is not None and data.numel() == dst.numel():
                    self._remember(dst, data.reshape(dst.shape))
                return False, None
            if _is_meta(src) and isinstance(dst, torch.Tensor):
                dst.copy_(
                    self._read(src, dst.dtype, dst.device).expand(dst.shape)
                    if src.dim()
                    else self._read(src, dst.dtype, dst.device)
                )
                return True, dst
        return False, None


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


__all__ = ["COPY_TO", "MetaData"]
