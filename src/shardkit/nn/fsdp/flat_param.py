"""Flat parameters: where each original parameter lives inside a unit's flat, padded, sharded buffer.

A wrapped unit concatenates its parameters (one flat parameter per ``(dtype, requires_grad)`` pair, or one per
parameter with ``flatten_parameters=False``) into a 1-D buffer, pads it to a multiple of the world size, and
keeps only chunk ``rank`` of it. :class:`FlatParamMeta` records that layout and is the one place other code
(state dicts, optimizer-state conversion, tests) reads it from::

    unpadded flat:  | p0 (numel0) | p1 (numel1) | ... | pk |
    padded flat:    | ............ numel ........... | pad |      padded_numel = world_size * shard_numel
    shards:         | rank 0 | rank 1 | ... | rank n-1 |        rank r holds [r * shard_numel, (r+1) * shard_numel)

Every FQN is relative to the module the :class:`~shardkit.nn.fsdp.FullyShardedDataParallel` instance wraps
(its ``.module``), written the way the unwrapped model names it. Tied parameters are stored once: the first
name seen owns the storage (:class:`ParamInfo`), later names are aliases (:class:`SharedParamInfo`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn


@dataclass(frozen=True)
class ParamInfo:
    """One original parameter stored in a flat parameter."""

    #: Name relative to the wrapped module, e.g. ``"blocks.0.fc1.weight"``.
    fqn: str
    #: Path of the submodule that owns the attribute (``""`` for the wrapped module itself).
    module_path: str
    #: Attribute name on that submodule, e.g. ``"weight"``.
    attr: str
    shape: torch.Size
    numel: int
    #: Start of this parameter in the unpadded flat buffer.
    offset: int
    requires_grad: bool


@dataclass(frozen=True)
class SharedParamInfo:
    """A second (third, ...) name of a tied parameter; its values are those of ``params[primary]``."""

    fqn: str
    module_path: str
    attr: str
    #: Index into :attr:`FlatParamMeta.params` of the parameter this name aliases.
    primary: int


class ShardSlice(NamedTuple):
    """The part of parameter ``param_index`` that lies in this rank's shard.

    Elements ``[param_start, param_end)`` of the flattened parameter are at ``[shard_start, shard_start +
    (param_end - param_start))`` of the local shard.
    """

    param_index: int
    param_start: int
    param_end: int
    shard_start: int


@dataclass(frozen=True)
class FlatParamMeta:
    """Layout of one flat parameter on one rank (see the module docstring for the picture)."""

    params: tuple[ParamInfo, ...]
    shared: tuple[SharedParamInfo, ...]
    dtype: torch.dtype
    requires_grad: bool
    #: Sum of the parameters' numels: length of the unpadded flat buffer.
    numel: int
    #: ``numel`` rounded up to a multiple of ``world_size`` so every shard has the same size, as
    #: all_gather_into_tensor and reduce_scatter_tensor require.
    padded_numel: int
    world_size: int
    rank: int

    @property
    def shard_numel(self) -> int:
        """Length of every rank's shard (padding included)."""
        return self.padded_numel // self.world_size

    @property
    def shard_offset(self) -> int:
        """Where this rank's shard starts in the padded flat buffer."""
        return self.rank * self.shard_numel

    @property
    def local_numel(self) -> int:
        """How many elements of this rank's shard are real parameter values (the rest is padding)."""
        return max(0, min(self.numel - self.shard_offset, self.shard_numel))

    def fqns(self) -> list[str]:
        """Every name stored here: owners first, then tied aliases."""
        return [p.fqn for p in self.params] + [s.fqn for s in self.shared]

    def split_sizes(self) -> list[int]:
        """Sizes that split the padded flat buffer into the parameters plus a trailing padding chunk."""
        sizes = [p.numel for p in self.params]
        pad = self.padded_numel - self.numel
        return sizes + [pad] if pad else sizes

    def views(self, full_flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of the padded full flat buffer shaped like the original parameters (one ``split`` node, so
        autograd sums their gradients into the flat buffer in a single step)."""
        chunks = torch.split(full_flat, self.split_sizes())
        return [chunk.view(info.shape) for chunk, info in zip(chunks, self.params)]

    def shard_slices(self) -> list[ShardSlice]:
        """For each parameter that overlaps this rank's shard, which part of it the shard holds."""
        lo, hi = self.shard_offset, self.shard_offset + self.shard_numel
        out = []
        for index, info in enumerate(self.params):
            start, end = max(lo, info.offset), min(hi, info.offset + info.numel)
            if start < end:
                out.append(ShardSlice(index, start - info.offset, end - info.offset, start - lo))
        return out

    def flatten(self, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Concatenate tensors shaped like :attr:`params` into a padded flat buffer on ``device``."""
        full = torch.zeros(self.padded_numel, dtype=self.dtype, device=device)
        for info, tensor in zip(self.params, tensors):
            full[info.offset : info.offset + info.numel].copy_(tensor.detach().reshape(-1))
        return full

    def local_shard(self, full_flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a padded full flat buffer (a view)."""
        return full_flat[self.shard_offset : self.shard_offset + self.shard_numel]


class ParamLocation(NamedTuple):
    """Where a parameter is registered: ``getattr(module, attr)`` inside the wrapped module."""

    module_path: str
    attr: str
    module: nn.Module

    @property
    def fqn(self) -> str:
        """The parameter's name relative to the wrapped module."""
        return f"{self.module_path}.{self.attr}" if self.module_path else self.attr


#: A unit's parameters, first occurrence first, and the later names of tied ones (index into the owners).
Owners = list[tuple[ParamLocation, nn.Parameter]]
Aliases = list[tuple[ParamLocation, int]]


def build_meta(
    owners: list[tuple[ParamLocation, nn.Parameter]],
    aliases: list[tuple[ParamLocation, int]],
    world_size: int,
    rank: int,
) -> FlatParamMeta:
    """Lay out ``owners`` (all of one dtype and requires_grad) one after another; ``aliases`` name tied copies
    by index into ``owners``."""
    params, offset = [], 0
    for loc, p in owners:
        params.append(ParamInfo(loc.fqn, loc.module_path, loc.attr, p.shape, p.numel(), offset, p.requires_grad))
        offset += p.numel()
    shared = tuple(SharedParamInfo(loc.fqn, loc.module_path, loc.attr, i) for loc, i in aliases)
    padded = -(-offset // world_size) * world_size if offset else world_size
    first = owners[0][1]
    return FlatParamMeta(tuple(params), shared, first.dtype, first.requires_grad, offset, padded, world_size, rank)
