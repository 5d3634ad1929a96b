"""The contract between the universal checkpoint layout and the strategies: which flat range of which tensor.

Every strategy keeps a tensor of the unwrapped model in one of a few shapes: whole (plain, DDP, OSS, smp, SlowMo),
or as a flat range of it inside a flat shard (FSDP). A :class:`Placement` says, for one local tensor, which
elements ``[start, stop)`` of which named full tensor it holds. That is all a strategy adapter has to say; the
layout turns placements into torch.distributed.checkpoint write and read plans, so any strategy reads what any
other wrote, at any world size.

Keys of the layout (the names of a plain ``model.state_dict()`` and of optimizer state per parameter name)::

    model/<fqn>                      a parameter or buffer, its full shape
    optim/<fqn>/<state name>         a tensor of the optimizer state of parameter <fqn> (exp_avg, step, ...)

A flat range of a row-major tensor is a union of at most ``2 * ndim - 1`` boxes, each contiguous in memory
(:func:`flat_boxes`), so every rank's piece is stored as ordinary DCP chunks with the tensor's real shape, and
torch's own DCP tools (``dcp_to_torch_save``) read the result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from shardkit.checkpoint.universal.split import Split, slab_numel

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"


def model_key(fqn: str) -> str:
    """The layout key of parameter or buffer ``fqn``."""
    return f"{MODEL_PREFIX}{fqn}"


def optim_key(fqn: str, state_name: str) -> str:
    """The layout key of optimizer state ``state_name`` (e.g. ``exp_avg``) of parameter ``fqn``."""
    return f"{OPTIM_PREFIX}{fqn}/{state_name}"


@dataclass(frozen=True)
class Box:
    """A box of a tensor: ``offsets`` and ``sizes`` per dimension, plus where it starts in the flat tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    #: Index of the box's first element in the flattened full tensor.
    flat_start: int

    @property
    def numel(self) -> int:
        """Number of elements in the box."""
        return math.prod(self.sizes)


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Split elements ``[start, stop)`` of a row-major tensor of ``shape`` into boxes, each contiguous in memory.

    A partial leading row, the whole rows, and a partial trailing row, recursively inside the partial rows; boxes
    come in flat order. A 0-d tensor is one box of no dimensions.

    Example::

        >>> [(b.offsets, b.sizes) for b in flat_boxes((3, 4), 2, 11)]
        [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    shape = tuple(int(d) for d in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of shape {shape} ({total} elements)")
    if start == stop:
        return []
    if not shape:
        return [Box((), (), 0)]
    return _boxes(shape, start, stop, 0)


def _boxes(shape: tuple[int, ...], start: int, stop: int, base: int) -> list[Box]:
    if len(shape) == 1:
        return [Box((start,), (stop - start,), base + start)]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    inner = shape[1:]
    zeros = (0,) * len(inner)
    if first == last:  # inside one row
        return [Box((first, *b.offsets), (1, *b.sizes), b.flat_start) for b in _row(inner, start, stop, first, base)]
    out: list[Box] = []
    whole_from = first
    if start % row:
        out += [Box((first, *b.offsets), (1, *b.sizes), b.flat_start) for b in _row(inner, start, None, first, base)]
        whole_from = first + 1
    whole_to = last + 1 if stop % row == 0 else last
    if whole_to > whole_from:
        out.append(Box((whole_from, *zeros), (whole_to - whole_from, *inner), base + whole_from * row))
    if stop % row:
        out += [Box((last, *b.offsets), (1, *b.sizes), b.flat_start) for b in _row(inner, last * row, stop, last, base)]
    return out


def _row(inner: tuple[int, ...], start: int, stop: int | None, index: int, base: int) -> list[Box]:
    """Boxes of row ``index`` covering flat ``[start, stop)`` (``stop=None``: to the end of the row)."""
    row = math.prod(inner)
    lo = start - index * row
    hi = row if stop is None else stop - index * row
    return _boxes(inner, lo, hi, base + index * row)


@dataclass(frozen=True)
class Placement:
    """One local tensor's share of one full tensor of the layout.

    ``local`` holds elements ``[start, stop)`` of the flattened full tensor ``key`` (global shape ``shape``):
    ``local.reshape(-1)[local_offset : local_offset + stop - start]``. On save it is read; on load the layout
    writes into it (so for loading it is a destination the adapter owns: a parameter's storage or a fresh buffer).
    """

    key: str
    shape: torch.Size
    dtype: torch.dtype
    start: int
    stop: int
    local: torch.Tensor
    local_offset: int = 0
    #: ``local`` is this rank's tensor-parallel slab of ``key`` and ``[start, stop)`` a range of it (:mod:`.split`).
    split: Optional[Split] = None

    def __post_init__(self) -> None:
        numel = slab_numel(self.shape, self.split)
        if not 0 <= self.start <= self.stop <= numel:
            raise ValueError(f"{self.key}: range [{self.start}, {self.stop}) is outside its {numel} elements")
        if self.local_offset < 0 or self.local_offset + self.stop - self.start > self.local.numel():
            raise ValueError(
                f"{self.key}: local tensor of {self.local.numel()} elements cannot hold {self.stop - self.start} "
                f"elements at offset {self.local_offset}"
            )

    def flat_local(self) -> torch.Tensor:
        """The 1-D view of ``local`` this placement covers (a view, so writes reach ``local``)."""
        return self.local.view(-1)[self.local_offset : self.local_offset + self.stop - self.start]

    def boxes(self) -> list[tuple[Box, torch.Tensor]]:
        """Each box of the range with the view of ``local`` holding it, shaped like the box."""
        flat = self.flat_local()
        split = self.split
        held_shape = self.shape if split is None else split.local_shape(self.shape)
        out = []
        for box in flat_boxes(held_shape, self.start, self.stop):
            view = flat[box.flat_start - self.start : box.flat_start - self.start + box.numel].view(box.sizes)
            if split is None:
                out.append((box, view))
                continue
            for offsets, sizes, at in split.full_boxes(self.shape, box.offsets, box.sizes):
                # flat_start stays where the part begins in the slab (the full tensor has no flat run for it)
                out.append((Box(offsets, sizes, box.flat_start), view.narrow(split.dim, at, sizes[split.dim])))
        return out


def replica_share(numel: int, replica_rank: int, replica_count: int) -> tuple[int, int]:
    """The flat range of a tensor that replica ``replica_rank`` of ``replica_count`` writes, so replicas split
    the writing of replicated state evenly (contiguous, sizes differing by at most one element)."""
    if not 0 <= replica_rank < replica_count:
        raise ValueError(f"replica rank {replica_rank} is outside 0..{replica_count - 1}")
    base, extra = divmod(numel, replica_count)
    start = replica_rank * base + min(replica_rank, extra)
    return start, start + base + (1 if replica_rank < extra else 0)
