"""Tensors split along one dimension (tensor parallelism) in the universal layout, stored without gathering.

A tensor-parallel rank holds a slab of a parameter: along dimension ``dim`` of the full tensor, ``size * stride``
equal pieces, of which it holds pieces ``rank, rank + size, ...`` (fairscale's ``stride`` for fused weights; one
piece, the ``rank``-th of ``size``, when ``stride`` is 1). A split along dimension 1 (a row-parallel weight) is not a
flat range of the full tensor, so the flat spans strategies report cannot describe it. Instead a :class:`Span` names
the full tensor and carries a :class:`Split`: its flat range indexes the rank's local slab (an FSDP flat shard of a
tensor-parallel model holds a flat range of it), and the layout maps every memory-contiguous box of the slab to the
box of the full tensor it is, cut at piece boundaries (:func:`full_boxes`).

Each rank therefore writes its slab as ordinary DCP chunks of the full-shaped tensor, the chunked metadata torch
writes for a ``DTensor`` with a ``Shard(dim)`` placement: no rank gathers anything, a loader at any degree (or
without tensor parallelism, or torch's own ``dcp_to_torch_save``) reads the boxes it needs from whichever chunks
overlap them, and the optimizer state (Adam's ``exp_avg``, laid out like the parameter) moves the same way.

:func:`tp_splits` finds the splits of a model's tensor-parallel layers (:mod:`shardkit.tensor_parallel`, through
its public :func:`~shardkit.tensor_parallel.tp_sharding`), and :func:`write_tp_layout` records them in
``tensor_parallel.json`` for ``shardkit checkpoint inspect``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from shardkit.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardkit.checkpoint.files import write_json_atomic

#: The file recording the tensor-parallel layout a checkpoint was saved with (informational: loading never needs it).
TP_LAYOUT_FILE = "tensor_parallel.json"


@dataclass(frozen=True)
class Split:
    """This rank's slab of a tensor split along ``dim`` into ``size * stride`` pieces (rank ``rank`` of ``size``).

    Example::

        >>> s = Split(dim=1, rank=1, size=2)       # a row-parallel weight of shape (4, 6): columns 3-5
        >>> tuple(s.local_shape((4, 6)))
        (4, 3)
        >>> s.full_boxes((4, 6), (0, 0), (4, 3))
        [((0, 3), (4, 3), 0)]
    """

    dim: int
    rank: int
    size: int
    stride: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or self.stride < 1 or not 0 <= self.rank < self.size or self.dim < 0:
            raise ValueError(f"invalid tensor-parallel split {self}: need 0 <= rank < size, stride >= 1, dim >= 0")

    def check(self, fqn: str, full_shape: Sequence[int]) -> None:
        """Refuse a full shape this split cannot cut evenly, naming the parameter, its sizes and the degrees that do."""
        if self.dim >= len(full_shape):
            raise ValueError(
                f"'{fqn}' of shape {tuple(full_shape)} is said to be split along dimension {self.dim}, which it lacks"
            )
        extent = int(full_shape[self.dim])
        if extent % (self.size * self.stride):
            parts = f" x stride {self.stride}" if self.stride > 1 else ""
            fitting = fitting_degrees(extent, self.stride)
            raise ValueError(
                f"'{fqn}': dimension {self.dim} of size {extent} (shape {tuple(full_shape)}) does not split across "
                f"{self.size} tensor-parallel ranks{parts}; degrees that divide it: {fitting}"
            )

    def full_shape(self, local_shape: Sequence[int]) -> torch.Size:
        """The full tensor's shape, from this rank's slab."""
        shape = list(local_shape)
        shape[self.dim] *= self.size
        return torch.Size(shape)

    def local_shape(self, full_shape: Sequence[int]) -> torch.Size:
        """This rank's slab's shape."""
        shape = list(full_shape)
        shape[self.dim] //= self.size
        return torch.Size(shape)

    def full_boxes(
        self, full_shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
    ) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """The box ``offsets``/``sizes`` of the slab as boxes of the full tensor, cut where pieces meet.

        Each is ``(full offsets, sizes, start)``, ``start`` being where along :attr:`dim` it begins inside the given
        box (so its data is the slab box's ``narrow(dim, start, sizes[dim])``)."""
        piece = int(full_shape[self.dim]) // (self.size * self.stride)
        lo, hi = int(offsets[self.dim]), int(offsets[self.dim]) + int(sizes[self.dim])
        out = []
        at = lo
        while at < hi:
            j, within = divmod(at, piece)
            length = min(hi, (j + 1) * piece) - at
            full_at = (self.rank + j * self.size) * piece + within
            box_offsets = (*offsets[: self.dim], full_at, *offsets[self.dim + 1 :])
            box_sizes = (*sizes[: self.dim], length, *sizes[self.dim + 1 :])
            out.append((tuple(int(o) for o in box_offsets), tuple(int(s) for s in box_sizes), at - lo))
            at += length
        return out


def fitting_degrees(extent: int, stride: int = 1) -> list[int]:
    """The tensor-parallel degrees that split a dimension of ``extent`` into ``stride`` equal parts per rank."""
    return [d for d in range(1, extent + 1) if extent % (d * stride) == 0]


def check_stored_fits(fqn: str, stored_shape: Sequence[int], here_shape: Sequence[int], split: Split) -> None:
    """Refuse a stored tensor that this rank's split cannot cut: the degree here does not divide the saved size.

    Run before the generic shape check, so a checkpoint saved at a degree whose sizes do not divide the new one (a
    vocabulary of 18 saved at 2 ranks, loaded at 4 into a model padded to 20) says so, naming the parameter, the
    sizes and the degrees that would load it, rather than only that the shapes differ."""
    if len(stored_shape) != len(here_shape) or split.dim >= len(stored_shape):
        return
    others_equal = all(a == b for d, (a, b) in enumerate(zip(stored_shape, here_shape)) if d != split.dim)
    extent = int(stored_shape[split.dim])
    if others_equal and extent != int(here_shape[split.dim]) and extent % (split.size * split.stride):
        raise IncompatibleCheckpointError(
            f"'{fqn}' is split along dimension {split.dim} across {split.size} tensor-parallel ranks here (full shape "
            f"{tuple(here_shape)}), but the checkpoint holds it with size {extent} along that dimension (shape "
            f"{tuple(stored_shape)}), which {split.size} ranks cannot split evenly. Load it at a tensor-parallel "
            f"degree that divides {extent}: {fitting_degrees(extent, split.stride)}, or pad it to the model's "
            "size first. Nothing was loaded."
        )


def tp_splits(module: nn.Module, clean_paths: Optional[dict[str, str]] = None) -> dict[str, Split]:
    """The :class:`Split` of every tensor-parallel parameter of ``module`` at a degree above 1, by state-dict name.

    ``clean_paths`` maps a module path of ``module`` to the name a wrapper's checkpoint uses for it (FSDP's wrapper
    levels add no segment). Empty when tensor parallelism was never imported (no model can then hold its layers).
    """
    tensor_parallel = sys.modules.get("shardkit.tensor_parallel")
    if tensor_parallel is None:
        return {}
    out: dict[str, Split] = {}
    for name, (spec, group) in tensor_parallel.tp_split_groups(module).items():
        if group.size > 1:
            out[clean_name(name, clean_paths)] = Split(spec.dim, group.rank, group.size, spec.stride)
    return out


def clean_name(name: str, clean_paths: Optional[dict[str, str]]) -> str:
    """The checkpoint name of the parameter ``name`` of a wrapped module: its owner's module path mapped by
    ``clean_paths`` (a wrapper's path -> the unwrapped module's, see :func:`tp_splits`); unchanged without one."""
    if clean_paths is None:
        return name
    owner, _, attr = name.rpartition(".")
    owner = clean_paths.get(owner, owner)
    return f"{owner}.{attr}" if owner else attr


def tp_degree(splits: dict[str, Split]) -> int:
    """The tensor-parallel degree of a model with these splits (1 without any)."""
    return max((s.size for s in splits.values()), default=1)


def split_of(splits: dict[str, Split], fqn: str, local_shape: Sequence[int]) -> tuple[torch.Size, Optional[Split]]:
    """The full shape of ``fqn``, held with ``local_shape`` here, and its split (None when it is whole), checked."""
    split = splits.get(fqn)
    if split is None:
        return torch.Size(local_shape), None
    full = split.full_shape(local_shape)
    split.check(fqn, full)
    return full, split


def write_tp_layout(directory: Path, splits: dict[str, tuple[torch.Size, Split]]) -> None:
    """Record which parameters were split, along which dimension and across how many ranks (rank 0 calls it)."""
    layout: dict[str, Any] = {
        "degree": tp_degree({fqn: s for fqn, (_, s) in splits.items()}),
        "parameters": {
            fqn: {"shape": list(shape), "dim": s.dim, "size": s.size, "stride": s.stride}
            for fqn, (shape, s) in sorted(splits.items())
        },
    }
    write_json_atomic(directory / TP_LAYOUT_FILE, layout)


def read_tp_layout(directory: Path) -> Optional[dict[str, Any]]:
    """What :func:`write_tp_layout` recorded in the checkpoint at ``directory``, or None (saved without tensor
    parallelism)."""
    path = directory / TP_LAYOUT_FILE
    if not path.exists():
        return None
    try:
        layout = json.loads(path.read_text())
        if not isinstance(layout, dict) or not isinstance(layout.get("parameters"), dict):
            raise ValueError("no 'parameters' table")
    except (OSError, ValueError) as err:
        raise CorruptCheckpointError(f"{path} cannot be read as a tensor-parallel layout ({err})") from None
    return layout


def slab_numel(full_shape: Sequence[int], split: Optional[Split]) -> int:
    """Elements of the tensor a rank holds: the whole tensor, or its slab."""
    return math.prod(full_shape if split is None else split.local_shape(full_shape))
