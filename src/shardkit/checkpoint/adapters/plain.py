"""A plain module or a torch ``DistributedDataParallel`` model with a ``torch.optim`` optimizer.

:class:`PlainSource` saves and loads the universal layout; :class:`PlainAdapter` reads checkpoints of the old
"full" layout.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint.adapters.full import FullStateAdapter
from shardkit.checkpoint.universal.source import Held, UniversalSource
from shardkit.checkpoint.universal.whole import whole_tensors
from shardkit.distributed.groups import group_rank, group_size


class PlainAdapter(FullStateAdapter):
    """Every rank holds the whole model and optimizer; rank 0 writes them. Keys are the unwrapped model's."""

    def __init__(self, model: nn.Module, optimizer: Optional[Any]) -> None:
        super().__init__(model, optimizer)
        self.strategy = "ddp" if isinstance(model, DistributedDataParallel) else "plain"

    @staticmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """The fallback: any module."""
        return True

    def unwrapped(self) -> nn.Module:
        if isinstance(self.model, DistributedDataParallel):
            return self.model.module
        return self.model


class PlainSource(UniversalSource):
    """A plain module or torch DDP with any ``torch.optim`` optimizer: whole tensors on every rank.

    Under DDP the replicas split the writing (each rank writes ``1 / world`` of every parameter; buffers come from
    rank 0). A plain module in a job with a process group may differ between ranks, so rank 0's copy is saved,
    as before the universal layout.

    Example::

        source = PlainSource(ddp_model, torch.optim.AdamW(ddp_model.parameters()))
        [h.spans[0].fqn for h in source.held()]   # the unwrapped model's state-dict names
    """

    def __init__(self, model: nn.Module, optimizer: Optional[Any]) -> None:
        self.model, self.optimizer = model, optimizer
        self.strategy = "ddp" if isinstance(model, DistributedDataParallel) else "plain"
        rank, size = 0, 1  # a plain module: every rank plans all of it, the lowest rank's copy is kept
        if isinstance(model, DistributedDataParallel) and dist.is_available() and dist.is_initialized():
            rank, size = group_rank(model.process_group), group_size(model.process_group)
        module = model.module if isinstance(model, DistributedDataParallel) else model
        self._held, self._aliases = whole_tensors(module, rank, size)

    @staticmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """Any module (the fallback)."""
        return True

    def held(self) -> list[Held]:
        return self._held

    def local_optimizer(self) -> Optional[torch.optim.Optimizer]:
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__name__}")
        return self.optimizer

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)
