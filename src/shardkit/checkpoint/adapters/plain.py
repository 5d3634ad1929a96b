"""A plain module or a torch ``DistributedDataParallel`` model with a ``torch.optim`` optimizer (full layout)."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint.adapters.full import FullStateAdapter


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
