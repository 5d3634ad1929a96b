"""``shardkit.optim.OSS`` (ZeRO-1), alone or with ``ShardedDataParallel`` (ZeRO-2) or torch DDP.

:class:`OSSSource` saves and loads the universal layout (each rank writes only its partition's optimizer state).
:class:`OSSAdapter` reads the old "full" layout: saving consolidated the sharded optimizer state on rank 0
(``consolidate_state_dict(recipient_rank=0)``, a collective, then ``state_dict()``): a plain ``torch.optim``
state dict, which ``OSS.load_state_dict`` re-shards at any world size; rank 0 wrote the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint.adapters.full import FullStateAdapter
from shardkit.checkpoint.adapters.registry import loaded_class
from shardkit.checkpoint.universal.source import Held, UniversalSource
from shardkit.checkpoint.universal.split import tp_splits
from shardkit.checkpoint.universal.whole import whole_tensors
from shardkit.distributed.groups import group_rank, group_size


class OSSAdapter(FullStateAdapter):
    """OSS optimizer over a plain, DDP or ShardedDataParallel model."""

    def __init__(self, model: nn.Module, optimizer: Optional[Any]) -> None:
        super().__init__(model, optimizer)
        sdp = loaded_class("shardkit.nn.sharded_ddp.api", "ShardedDataParallel")
        self.strategy = "oss_sdp" if sdp is not None and isinstance(model, sdp) else "oss"

    @staticmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """An OSS optimizer, or a ShardedDataParallel model (which only works with OSS)."""
        oss = loaded_class("shardkit.optim.zero1.optimizer", "OSS")
        sdp = loaded_class("shardkit.nn.sharded_ddp.api", "ShardedDataParallel")
        return (oss is not None and isinstance(optimizer, oss)) or (sdp is not None and isinstance(model, sdp))

    def unwrapped(self) -> nn.Module:
        sdp = loaded_class("shardkit.nn.sharded_ddp.api", "ShardedDataParallel")
        if isinstance(self.model, DistributedDataParallel) or (sdp is not None and isinstance(self.model, sdp)):
            inner: nn.Module = self.model.module  # type: ignore[assignment]
            return inner
        return self.model

    def optimizer_state(self) -> Optional[Mapping[str, Any]]:
        optimizer = self.optimizer
        assert optimizer is not None
        optimizer.consolidate_state_dict(recipient_rank=0)
        return optimizer.state_dict() if optimizer.rank == 0 else None


class OSSSource(UniversalSource):
    """OSS (alone, under torch DDP or ShardedDataParallel) for the universal layout.

    The model is whole on every rank (the ranks split its writing); the optimizer state is OSS's local partition
    optimizer over the parameters this rank owns, each owned parameter written whole by its owner (under hybrid
    sharding the owners on the other nodes split it). Loading builds the local state and hands it to
    ``OSS.load_state_dict``, which keeps what this rank owns at any world size.

    Example::

        source = OSSSource(ShardedDataParallel(model, optimizer), optimizer)
    """

    def __init__(self, model: nn.Module, optimizer: Optional[Any]) -> None:
        self.model, self.optimizer = model, optimizer
        sdp = loaded_class("shardkit.nn.sharded_ddp.api", "ShardedDataParallel")
        self.strategy = "oss_sdp" if sdp is not None and isinstance(model, sdp) else "oss"
        rank, size = (
            (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        )
        if tp_splits(_unwrapped(model)) and hasattr(optimizer, "partition_parameters"):
            # tensor-parallel slabs are the same only across OSS's data-parallel ranks, not the whole job
            rank, size = _data_replicas(optimizer)
        self._held, self._aliases = whole_tensors(_unwrapped(model), rank, size)

    @staticmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """An OSS optimizer, or a ShardedDataParallel model."""
        return OSSAdapter.handles(model, optimizer)

    def _oss(self) -> Any:
        if self.optimizer is None:
            return None
        if not hasattr(self.optimizer, "partition_parameters"):
            raise TypeError(f"a ShardedDataParallel model needs its OSS optimizer, got {type(self.optimizer).__name__}")
        return self.optimizer

    def held(self) -> list[Held]:
        return self._held

    def local_optimizer(self) -> Optional[torch.optim.Optimizer]:
        oss = self._oss()
        return None if oss is None else oss.optim

    def optimizer_replicas(self) -> Optional[tuple[int, int]]:
        oss = self._oss()
        if oss is None or oss.replica_group is None:
            return (0, 1)
        return group_rank(oss.replica_group), group_size(oss.replica_group)

    def group_fqns(self) -> Optional[list[list[str]]]:
        oss = self._oss()
        if oss is None:
            return None
        names = {id(h.tensor): h.spans[0].fqn for h in self._held}
        return [[names[id(p)] for p in group["params"] if id(p) in names] for group in oss.param_groups]

    def group_settings(self) -> Optional[list[dict[str, Any]]]:
        oss = self._oss()
        return None if oss is None else [dict(g) for g in oss.param_groups]

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def load_optimizer(self, state_dict: dict[str, Any]) -> None:
        """Renumber the local state to OSS's global parameter order and load it through ``OSS.load_state_dict``."""
        oss = self._oss()
        position = {id(p): i for i, p in enumerate(p for g in oss.param_groups for p in g["params"])}
        local = [p for g in oss.optim.param_groups for p in g["params"]]
        global_groups = []
        for group, saved in zip(oss.param_groups, state_dict["param_groups"]):
            settings = {k: v for k, v in saved.items() if k != "params"}
            global_groups.append({**settings, "params": [position[id(p)] for p in group["params"]]})
        state = {position[id(local[i])]: value for i, value in state_dict["state"].items()}
        # the engine built these tensors for this load alone: OSS adopts them rather than copying its whole state
        oss.load_state_dict({"state": state, "param_groups": global_groups}, copy_state=False)


def _data_replicas(oss: Any) -> tuple[int, int]:
    """This rank's index among the ranks OSS shards and replicates over, and their number."""
    if oss.replica_group is None:
        return group_rank(oss.group), group_size(oss.group)
    replica_rank, replicas = group_rank(oss.replica_group), group_size(oss.replica_group)
    return replica_rank * group_size(oss.group) + group_rank(oss.group), replicas * group_size(oss.group)


def _unwrapped(model: nn.Module) -> nn.Module:
    sdp = loaded_class("shardkit.nn.sharded_ddp.api", "ShardedDataParallel")
    if isinstance(model, DistributedDataParallel) or (sdp is not None and isinstance(model, sdp)):
        inner: nn.Module = model.module  # type: ignore[assignment]
        return inner
    return model
