"""``shardkit.nn.FullyShardedDataParallel`` (ZeRO-3) in the universal layout: every rank saves and loads its rows.

Each wrapped unit keeps, per flat parameter, one shard of ``[p0 | p1 | ... | padding]`` (see
:mod:`shardkit.nn.fsdp.flat_param`). :class:`FSDPSource` tells the layout which elements of which original
parameter every shard holds (:func:`~shardkit.checkpoint.adapters.fsdp_spans.flat_param_pieces`), named as the
unwrapped model names it, so nothing is gathered: a rank writes its rows on save and reads exactly its rows on
load, whatever strategy and world size wrote the checkpoint. The optimizer state follows the shards it belongs to
(the engine maps it by parameter identity).

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
from shardkit.checkpoint.adapters.fsdp_spans import (
    flat_param_aliases,
    flat_param_pieces,
    join_name,
    unit_replicas,
)
from shardkit.checkpoint.adapters.registry import isinstance_of
from shardkit.checkpoint.universal.source import Held, Span, UniversalSource
from shardkit.distributed.groups import group_rank, group_size

_FSDP = ("shardkit.nn.fsdp.api", "FullyShardedDataParallel")


def _unit_modules(model: nn.Module) -> list[tuple[str, Any]]:
    """``(clean path, unit)`` of every FSDP unit under ``model`` (itself included), each once, pre-order."""
    from shardkit.nn.fsdp.unit_module import UnitModule, walk_modules

    return [(path, m) for path, _, m in walk_modules(model) if isinstance(m, UnitModule)]


def _replicas(path: str, unit: Any, world: int) -> tuple[int, int]:
    """This rank's index among the ranks holding the same shards of ``unit`` (its replica group under hybrid
    sharding and NO_SHARD), and their number."""
    replica_group = unit.replica_group
    if replica_group is None:
        return unit_replicas(path or "<root>", unit.world_size, 0, 1, world)
    return unit_replicas(path or "<root>", unit.world_size, group_rank(replica_group), group_size(replica_group), world)


class FSDPSource(UniversalSource):
    """An FSDP model (root unit) and the ``torch.optim`` optimizer over its flat parameter shards."""

    strategy = "fsdp"

    def __init__(self, model: nn.Module, optimizer: Optional[Any]) -> None:
        self.model = model
        self.optimizer = optimizer
        #: id(buffer) -> (staging copy in the original dtype, the buffer), for buffers mixed precision cast; made
        #: once per source, so every held() hands out the same copy the engine reads or fills.
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """An FSDP model."""
        return isinstance_of(model, *_FSDP)

    def _check_idle(self) -> None:
        from shardkit.nn.fsdp.runtime import TrainingState

        for path, unit in _unit_modules(self.model):
            if unit.training_state != TrainingState.IDLE:
                raise RuntimeError(
                    f"a checkpoint of an FSDP model was requested while unit '{path or '<root>'}' is in state "
                    f"{unit.training_state.name}: save and load between training steps, outside forward, backward "
                    "and summon_full_params()"
                )

    def held(self) -> list[Held]:
        """Every unit's flat parameter shards with the ranges they hold, then every buffer whole."""
        self._check_idle()
        _, world = rank_and_size()
        out: list[Held] = []
        for path, unit in _unit_modules(self.model):
            replica_rank, replica_count = _replicas(path, unit, world)
            for shard, meta in zip(unit.flat_params, unit.flat_param_metas):
                spans = tuple(
                    Span(p.fqn, p.shape, p.start, p.stop, p.local_offset) for p in flat_param_pieces(path, meta)
                )
                # A shard of padding only has no span, but stays listed: the optimizer steps it.
                out.append(Held(shard, spans, replica_rank, replica_count))
        out.extend(self._buffers())
        return out

    def _buffers(self) -> list[Held]:
        from shardkit.nn.fsdp.unit_module import UnitModule, walk_modules

        original = dict(getattr(self.model, "buffer_original_dtypes", {}))
        out: list[Held] = []
        seen: set[int] = set()
        for path, _, module in walk_modules(self.model, once=False):
            if isinstance(module, UnitModule):
                continue
            for attr, buf in module._buffers.items():
                if buf is None or attr in module._non_persistent_buffers_set or id(buf) in seen:
                    continue
                seen.add(id(buf))
                fqn = join_name(path, attr)
                tensor = buf
                dtype = original.get(fqn)
                if dtype is not None and dtype != buf.dtype:
                    if id(buf) not in self._staged:
                        self._staged[id(buf)] = (buf.detach().to(dtype), buf)
                    tensor = self._staged[id(buf)][0]
                out.append(Held(tensor, (Span(fqn, buf.shape, 0, buf.numel(), 0),), 0, 1))
        return out

    def local_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer passed in: it steps exactly the flat parameter shards."""
        return self.optimizer

    def group_fqns(self) -> Optional[list[list[str]]]:
        """Per optimizer parameter group, every original parameter its flat shards carry (on any rank)."""
        if self.optimizer is None:
            return None
        names: dict[int, list[str]] = {}
        for path, unit in _unit_modules(self.model):
            for shard, meta in zip(unit.flat_params, unit.flat_param_metas):
                names[id(shard)] = [join_name(path, info.fqn) for info in meta.params]
        return [[fqn for p in group["params"] for fqn in names.get(id(p), [])] for group in self.optimizer.param_groups]

    def aliases(self) -> dict[str, str]:
        """Tied parameter names (stored once) and buffers reached along several module paths."""
        from shardkit.nn.fsdp.unit_module import UnitModule, walk_modules

        out: dict[str, str] = {}
        for path, unit in _unit_modules(self.model):
            for meta in unit.flat_param_metas:
                out.update(flat_param_aliases(path, meta))
        first: dict[int, str] = {}
        for path, _, module in walk_modules(self.model, once=False):
            if isinstance(module, UnitModule):
                continue
            for attr, buf in module._buffers.items():
                if buf is None or attr in module._non_persistent_buffers_set:
                    continue
                fqn = join_name(path, attr)
                if first.setdefault(id(buf), fqn) != fqn:
                    out[fqn] = first[id(buf)]
        return out

    def before_save(self) -> None:
        """FSDP must be between steps."""
        self._check_idle()

    def after_load(self) -> None:
        """Cast staged buffers back into the model's buffers and drop stale gathered copies."""
        with torch.no_grad():
            for staged, buf in self._staged.values():
                buf.copy_(staged)
        self._staged = {}
        for _, unit in _unit_modules(self.model):
            unit.fsdp_unit.group.reshard()


__all__ = ["FSDPAdapter", "FSDPSource"]
