"""The read model of a wrapped model's shards: one frozen view of where every original parameter lives.

:func:`layout` walks a :class:`~shardkit.nn.fsdp.FullyShardedDataParallel` tree once and answers, in the names
of the unwrapped model (wrapper levels add no segment):

- per unit (:class:`UnitLayout`): its clean path, shard group, rank, world size, replicas and state;
- per flat parameter (:class:`FlatLayout`): which original parameters it concatenates, at which offsets, with
  which shapes, dtype and padding (its :class:`~shardkit.nn.fsdp.flat_param.FlatParamMeta`), and
  :meth:`FlatLayout.pieces`: which slice of which parameter any rank of the group holds;
- every name ``state_dict()`` gives a parameter (:class:`ParamName`; tied names marked as aliases) and every
  persistent buffer (:class:`BufferLayout`, with the dtype it had before mixed precision cast it), in
  ``state_dict()`` order.

The state dicts, the checkpoint adapters and the Lightning checkpoint code read FSDP through this view and
:meth:`~shardkit.nn.fsdp.FullyShardedDataParallel.summon_full_params` (the one context that shows full
parameters), never through a unit's run-time objects. The view is taken between steps: its fields never change,
while the tensors it points at (``FlatLayout.shard``, ``BufferLayout.tensor``) are the model's own.

Example::

    view = layout(model)                      # model: the root FullyShardedDataParallel
    for flat in view.flats:
        print(flat.key, flat.meta.numel, flat.padding, flat.fqns)
        for piece in flat.pieces(rank=1):     # what rank 1 of the unit's group holds
            print(piece.fqn, piece.start, piece.stop, piece.local_offset)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
from torch import nn

from shardkit.distributed.groups import GroupLike
from shardkit.nn.fsdp.flat_param import FlatParamMeta
from shardkit.nn.fsdp.runtime import TrainingState
from shardkit.nn.fsdp.unit_module import UnitModule, join_name, walk_modules


class FlatPiece(NamedTuple):
    """Elements ``[start, stop)`` of the flattened full tensor ``fqn`` (shape ``shape``) sit at
    ``shard.view(-1)[local_offset : local_offset + stop - start]``."""

    fqn: str
    shape: torch.Size
    start: int
    stop: int
    local_offset: int


def flat_param_pieces(prefix: str, meta: FlatParamMeta) -> list[FlatPiece]:
    """The pieces of original parameters ``meta.rank``'s shard of one flat parameter holds, in shard order.

    ``prefix`` is the clean path of the unit owning the flat parameter (``""`` for the root). Padding holds no
    parameter and yields no piece; a rank whose chunk is all padding gets an empty list.
    """
    pieces = []
    for s in meta.shard_slices():
        info = meta.params[s.param_index]
        pieces.append(FlatPiece(join_name(prefix, info.fqn), info.shape, s.param_start, s.param_end, s.shard_start))
    return pieces


def flat_param_aliases(prefix: str, meta: FlatParamMeta) -> dict[str, str]:
    """Tied names stored in one flat parameter: alias name -> the name whose values are stored."""
    return {join_name(prefix, s.fqn): join_name(prefix, meta.params[s.primary].fqn) for s in meta.shared}


@dataclass(frozen=True)
class FlatLayout:
    """One flat parameter of one unit: ``[p0 | p1 | ... | padding]``, of which this rank keeps one chunk."""

    #: The shard's key in ``local_state_dict()``: ``"<unit path>.flat_param_<i>"``.
    key: str
    #: Clean path of the owning unit (``""`` for the layout's root).
    unit_path: str
    #: Offsets, shapes, dtype, padding, world size and rank (names relative to the unit).
    meta: FlatParamMeta
    #: The names of ``meta.params`` from the layout's root.
    fqns: tuple[str, ...]
    #: The shard group of the owning unit, where the flat parameter is gathered.
    process_group: GroupLike = field(compare=False, repr=False)
    #: Where a gathered copy goes (the unit's compute device).
    compute_device: torch.device = field(compare=False)
    #: How collectives on this flat parameter are labelled (``"<unit>.flat_param_<i>"``).
    label: str = field(compare=False)
    #: This rank's shard: the ``nn.Parameter`` the optimizer steps (the model's own tensor).
    shard: nn.Parameter = field(compare=False, repr=False)

    @property
    def padding(self) -> int:
        """Elements added after the last parameter so every rank's chunk has the same size."""
        return self.meta.padded_numel - self.meta.numel

    def pieces(self, rank: Optional[int] = None) -> list[FlatPiece]:
        """Which slice of which original parameter ``rank``'s chunk holds (default: this rank's), named from
        the layout's root."""
        meta = self.meta if rank is None else dataclasses.replace(self.meta, rank=rank)
        if not 0 <= meta.rank < meta.world_size:
            raise ValueError(f"{self.key}: rank {meta.rank} is outside the unit's group of {meta.world_size}")
        return flat_param_pieces(self.unit_path, meta)

    def aliases(self) -> dict[str, str]:
        """Tied names stored here: alias name -> the stored name (both from the layout's root)."""
        return flat_param_aliases(self.unit_path, self.meta)


@dataclass(frozen=True)
class UnitLayout:
    """One wrapped unit: its place in the tree, its groups and its flat parameters."""

    #: Clean path from the layout's root (``""`` for the root itself).
    path: str
    #: The unit's name in messages (its path from the tree's root, ``<root ...>`` for the root).
    name: str
    #: Its training state when the view was taken (readers refuse to run unless every unit is IDLE).
    state: TrainingState
    rank: int
    world_size: int
    #: Set by the argument, or for a nested unit alone in its group under a bigger root (fairscale's rule).
    no_broadcast_optim_state: bool
    flats: tuple[FlatLayout, ...]
    process_group: GroupLike = field(compare=False, repr=False)
    #: The ranks holding the same shards (hybrid sharding, NO_SHARD); None without replicas.
    replica_group: Optional[GroupLike] = field(compare=False, repr=False)


@dataclass(frozen=True)
class ParamName:
    """One name ``state_dict()`` gives an original parameter: its values are ``flat.param(index)``'s.

    A module reached along two paths gives its parameters two names; a tied parameter's later names are
    ``alias`` names of the stored one.
    """

    key: str
    flat: FlatLayout
    index: int
    alias: bool

    @property
    def shape(self) -> torch.Size:
        """The original parameter's shape."""
        return self.flat.meta.params[self.index].shape


@dataclass(frozen=True)
class BufferLayout:
    """One persistent buffer, held whole by every rank: ``getattr(module, attr)``."""

    key: str
    module: nn.Module = field(compare=False, repr=False)
    attr: str
    #: The dtype before mixed precision cast it (None: not cast); what state dicts save and load.
    original_dtype: Optional[torch.dtype]

    @property
    def tensor(self) -> torch.Tensor:
        """The module's buffer as it is now."""
        buf = self.module._buffers[self.attr]
        assert buf is not None
        return buf

    def value(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """The buffer detached, in its original dtype, on ``device`` (default: where it is)."""
        buf = self.tensor
        return buf.detach().to(device=device or buf.device, dtype=self.original_dtype or buf.dtype)

    def load(self, value: torch.Tensor) -> None:
        """Copy ``value`` into the buffer (cast to the buffer's dtype)."""
        with torch.no_grad():
            self.tensor.copy_(value)


@dataclass(frozen=True)
class ShardLayout:
    """Every unit, flat parameter, parameter name and buffer of a wrapped model (see the module docstring)."""

    #: Pre-order, each unit once (at the first path that reaches it).
    units: tuple[UnitLayout, ...]
    #: In ``state_dict()`` order.
    params: tuple[ParamName, ...]
    #: Persistent buffers in ``state_dict()`` order (a module reached along two paths gives two entries).
    buffers: tuple[BufferLayout, ...]
    #: ``(path, version)`` of every module that is not a unit, in ``state_dict()`` order (torch's ``_metadata``).
    module_versions: tuple[tuple[str, int], ...]

    @property
    def flats(self) -> tuple[FlatLayout, ...]:
        """Every flat parameter, unit by unit."""
        return tuple(flat for unit in self.units for flat in unit.flats)

    def busy_unit(self) -> Optional[UnitLayout]:
        """The first unit that was not IDLE when the view was taken (None: safe to read and write)."""
        return next((u for u in self.units if u.state != TrainingState.IDLE), None)

    def require_idle(self, what: str) -> ShardLayout:
        """This view, or an error naming ``what`` and the busy unit when any unit was inside forward, backward
        or ``summon_full_params()`` (state dicts and checkpoints are only read and written between steps)."""
        busy = self.busy_unit()
        if busy is not None:
            raise RuntimeError(
                f"{what} was called while unit '{busy.name}' is in state {busy.state.name}; call it between "
                "training steps, outside forward, backward and summon_full_params()"
            )
        return self

    def expected_shapes(self) -> dict[str, torch.Size]:
        """The shape every key of a full state dict must have."""
        shapes = {p.key: p.shape for p in self.params}
        shapes.update((b.key, b.tensor.shape) for b in self.buffers)
        return shapes

    def state_dict_keys(self) -> list[str]:
        """Keys of ``state_dict()`` in its order: module by module, parameters before buffers."""
        by_module: dict[str, list[str]] = {}
        for key in [p.key for p in self.params] + [b.key for b in self.buffers]:
            by_module.setdefault(key.rpartition(".")[0], []).append(key)
        return [key for path, _ in self.module_versions for key in by_module.pop(path, [])]


def layout(model: nn.Module) -> ShardLayout:
    """The frozen layout view of ``model``, a :class:`~shardkit.nn.fsdp.FullyShardedDataParallel` (usually the
    root; a nested unit gives the view of its subtree, named from it). No communication. Example::

        view = shardkit.nn.fsdp.layout(model)
        assert view.state_dict_keys() == list(plain_model.state_dict())   # the unwrapped model's keys
    """
    if not isinstance(model, UnitModule):
        raise TypeError(f"layout() reads a FullyShardedDataParallel model, got {type(model).__name__}")
    units: dict[int, UnitLayout] = {}
    located: _Located = {}
    # Like nn.Module.state_dict, a module reached along several paths appears once per path.
    for path, _, unit in walk_modules(model, once=False):
        if isinstance(unit, UnitModule) and id(unit) not in units:
            units[id(unit)] = _unit_layout(path, unit, located)
    params: list[ParamName] = []
    buffers: list[BufferLayout] = []
    versions: list[tuple[str, int]] = []
    original = _buffer_dtypes(model)
    for path, _, module in walk_modules(model, once=False):
        if isinstance(module, UnitModule):
            continue
        versions.append((path, getattr(module, "_version", 1)))
        params.extend(ParamName(join_name(path, a), f, i, alias) for a, f, i, alias in located.get(id(module), []))
        for attr, buf in module._buffers.items():
            if buf is not None and attr not in module._non_persistent_buffers_set:
                key = join_name(path, attr)
                buffers.append(BufferLayout(key, module, attr, original.get(key)))
    return ShardLayout(tuple(units.values()), tuple(params), tuple(buffers), tuple(versions))


#: id(module) -> ``(attribute, flat parameter, index, alias)`` of every original parameter registered on it.
_Located = dict[int, list[tuple[str, FlatLayout, int, bool]]]


def _unit_layout(path: str, unit: UnitModule, located: _Located) -> UnitLayout:
    """One unit's view; records where each of its parameters is registered (by module) in ``located``."""
    run = unit.fsdp_unit
    flats = []
    for h in run.group.handles:
        fqns = tuple(join_name(path, info.fqn) for info in h.meta.params)
        flat = FlatLayout(
            join_name(path, h.name), path, h.meta, fqns, unit.process_group, h.compute_device, h.label, h.shard
        )
        flats.append(flat)
        for i, (module, attr) in enumerate(h.locations):
            located.setdefault(id(module), []).append((attr, flat, i, False))
        for (module, attr), info in zip(h.alias_locations, h.meta.shared):
            located.setdefault(id(module), []).append((attr, flat, info.primary, True))
    return UnitLayout(
        path,
        run.name,
        run.state,
        unit.rank,
        unit.world_size,
        unit.no_broadcast_optim_state,
        tuple(flats),
        unit.process_group,
        run.policies.reduce.replica_group,
    )


def _buffer_dtypes(model: UnitModule) -> dict[str, torch.dtype]:
    """Original dtypes of buffers that mixed precision cast (recorded by the root), keyed relative to ``model``."""
    root_unit = model.fsdp_unit.root
    if root_unit is None:
        return dict(model.buffer_original_dtypes)
    root = root_unit.group.owner
    assert isinstance(root, UnitModule)
    prefix = next((p for p, _, m in walk_modules(root, once=False) if m is model), "")
    cut = len(prefix) + 1 if prefix else 0
    return {k[cut:]: v for k, v in root.buffer_original_dtypes.items() if not prefix or k.startswith(prefix + ".")}


def reshard(model: nn.Module, recurse: bool = True) -> None:
    """Free the gathered full parameters of every unit (``recurse=False``: of ``model`` alone). After a load,
    full copies kept from a forward without backward would be stale."""
    for _, _, unit in walk_modules(model):
        if isinstance(unit, UnitModule) and (recurse or unit is model):
            unit.fsdp_unit.group.reshard()
