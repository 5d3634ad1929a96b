"""``shardkit.nn.FullyShardedDataParallel`` (ZeRO-3) in the universal layout: every rank saves and loads its rows.

Each wrapped unit keeps, per flat parameter, one shard of ``[p0 | p1 | ... | padding]`` (see
:mod:`shardkit.nn.fsdp.flat_param`). :class:`FSDPSource` reads the FSDP read model (:func:`shardkit.nn.fsdp.layout`):
which elements of which original parameter every shard holds, named as the unwrapped model names it, so nothing
is gathered: a rank writes its rows on save and reads exactly its rows on load, whatever strategy and world size
wrote the checkpoint. The optimizer state follows the shards it belongs to (the engine maps it by parameter
identity).

- **Nested units** prefix their clean path (the wrapper levels add no segment).
- **Mixed precision**: the shard is the FP32 master copy (the low-precision copy is only ever the gathered full
  parameter), so that is what is saved and restored. Buffers cast to a low precision are saved in their original
  dtype (a staging copy), and cast back on load.
- **CPU offload**: the shards live in CPU memory and are read and written there.
- **Hybrid sharding / NO_SHARD**: a unit sharded over groups of ``world_size`` ranks has
  ``world // world_size`` replicas, which split the writing of their common shard.
- **Tied parameters** are stored once, under the first name; later names are aliases.
- Buffers are held whole by every rank and written by the lowest rank alone (replica ``(0, 1)``): replicas may
  differ (BatchNorm statistics after a local forward), as a save from rank 0 would keep them.

The legacy ``fsdp-dcp`` layout is read and written by :class:`FSDPAdapter` (see :mod:`.fsdp_legacy`).

Example::

    save_checkpoint("ckpt/step_10", step=10, model=fsdp_model, optimizer=optimizer)
    load_checkpoint("ckpt/step_10", model=plain_model, optimizer=plain_optimizer)  # any strategy, any size
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from shardkit.checkpoint._collectives import rank_and_size
from shardkit.checkpoint.adapters.fsdp_legacy import FSDPAdapter
from shardkit.checkpoint.universal.source import Held, Span, UniversalSource
from shardkit.checkpoint.universal.split import Split, split_of, tp_degree, tp_splits
from shardkit.distributed.groups import group_rank, group_size
from shardkit.nn.fsdp.shard_layout import BufferLayout, FlatPiece, ShardLayout, UnitLayout, layout, reshard
from shardkit.nn.fsdp.unit_module import walk_modules


def unit_replicas(
    unit_name: str, shard_size: int, replica_rank: int, replica_count: int, world_size: int, tp_size: int = 1
) -> tuple[int, int]:
    """``(replica_rank, replica_count)`` of a unit whose shard group has ``shard_size`` ranks, checked.

    The ranks holding the same shards are the unit's replica group (hybrid sharding: the same local rank on every
    node; NO_SHARD: every rank); without one, the unit must shard over the whole job, or over the data-parallel
    group of a model split across ``tp_size`` tensor-parallel ranks (each holds its own slabs). Anything else (a
    unit over a subgroup with no replicas, e.g. per-rank experts) may hold different values per group, which one
    checkpoint key cannot: refused.

    Example::

        >>> unit_replicas("blocks.0", 4, 1, 2, 8)   # hybrid: node 1's copy of 4-way shards, 2 nodes
        (1, 2)
    """
    if shard_size * replica_count * tp_size != world_size:
        across = f" x tensor-parallel degree {tp_size}" if tp_size > 1 else ""
        raise ValueError(
            f"FSDP unit '{unit_name}' is sharded over {shard_size} ranks with {replica_count} replica(s){across}, "
            f"which is not the {world_size} ranks of this job: its groups may hold different values (e.g. per-rank "
            "experts), which one checkpoint cannot store. Shard every unit over the whole job"
            + (" (with tensor parallelism: over the data-parallel group)" if tp_size > 1 else "")
            + ", or use sharding_strategy=HYBRID_SHARD for replicas across nodes"
        )
    if not 0 <= replica_rank < replica_count:
        raise ValueError(f"FSDP unit '{unit_name}': replica rank {replica_rank} is outside 0..{replica_count - 1}")
    return replica_rank, replica_count


def _replicas(unit: UnitLayout, world: int, tp_size: int) -> tuple[int, int]:
    """This rank's index among the ranks holding the same shards of ``unit``, and their number."""
    replicas = unit.replica_group
    rank, count = (0, 1) if replicas is None else (group_rank(replicas), group_size(replicas))
    return unit_replicas(unit.path or "<root>", unit.world_size, rank, count, world, tp_size)


def _tp_splits(model: nn.Module) -> dict[str, Split]:
    """The tensor-parallel splits of the wrapped model's parameters, by the unwrapped model's names."""
    return tp_splits(model, {real: clean for clean, real, _ in walk_modules(model)})


def _span(piece: FlatPiece, splits: dict[str, Split]) -> Span:
    """A flat shard's piece of one parameter; of its tensor-parallel slab where the parameter is split."""
    shape, split = split_of(splits, piece.fqn, piece.shape)
    return Span(piece.fqn, shape, piece.start, piece.stop, piece.local_offset, split)


def _unique_buffers(view: ShardLayout) -> tuple[list[BufferLayout], dict[str, str]]:
    """Each buffer once (its first name), and the other names of buffers reached along several module paths."""
    first: dict[int, str] = {}
    unique, aliases = [], {}
    for b in view.buffers:
        stored = first.setdefault(id(b.tensor), b.key)
        if stored == b.key:
            unique.append(b)
        else:
            aliases[b.key] = stored
    return unique, aliases


class FSDPSource(UniversalSource):
    """An FSDP model (root unit) and the ``torch.optim`` optimizer over its flat parameter shards."""

    strategy = "fsdp"
    #: An FSDP model (the models the legacy layout's adapter takes).
    handles = staticmethod(FSDPAdapter.handles)

    def __init__(self, model: nn.Module, optimizer: Optional[Any]) -> None:
        self.model = model
        self.optimizer = optimizer
        #: id(buffer) -> (staging copy in the original dtype, the buffer), for buffers mixed precision cast; made
        #: once per source, so every held() hands out the same copy the engine reads or fills.
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def held(self) -> list[Held]:
        """Every unit's flat parameter shards with the ranges they hold, then every buffer whole."""
        view = layout(self.model).require_idle("save_checkpoint() or load_checkpoint()")
        _, world = rank_and_size()
        splits = _tp_splits(self.model)
        out: list[Held] = []
        for unit in view.units:
            replica_rank, replica_count = _replicas(unit, world, tp_degree(splits))
            for flat in unit.flats:
                spans = tuple(_span(p, splits) for p in flat.pieces())
                # A shard of padding only has no span, but stays listed: the optimizer steps it.
                out.append(Held(flat.shard, spans, replica_rank, replica_count))
        for b in _unique_buffers(view)[0]:
            buf, tensor = b.tensor, b.tensor
            if b.original_dtype is not None and b.original_dtype != buf.dtype:
                if id(buf) not in self._staged:
                    self._staged[id(buf)] = (b.value(), buf)
                tensor = self._staged[id(buf)][0]
            out.append(Held(tensor, (Span(b.key, buf.shape, 0, buf.numel(), 0),), 0, 1))
        return out

    def local_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer passed in: it steps exactly the flat parameter shards."""
        return self.optimizer

    def group_fqns(self) -> Optional[list[list[str]]]:
        """Per optimizer parameter group, every original parameter its flat shards carry (on any rank)."""
        if self.optimizer is None:
            return None
        names = {id(flat.shard): list(flat.fqns) for flat in layout(self.model).flats}
        return [[fqn for p in group["params"] for fqn in names.get(id(p), [])] for group in self.optimizer.param_groups]

    def aliases(self) -> dict[str, str]:
        """Tied parameter names (stored once) and buffers reached along several module paths."""
        view = layout(self.model)
        out: dict[str, str] = {}
        for flat in view.flats:
            out.update(flat.aliases())
        out.update(_unique_buffers(view)[1])
        return out

    def before_save(self) -> None:
        """FSDP must be between steps."""
        layout(self.model).require_idle("save_checkpoint()")

    def after_load(self) -> None:
        """Cast staged buffers back into the model's buffers and drop stale gathered copies."""
        with torch.no_grad():
            for staged, buf in self._staged.values():
                buf.copy_(staged)
        self._staged = {}
        reshard(self.model)


__all__ = ["FSDPAdapter", "FSDPSource", "unit_replicas"]
