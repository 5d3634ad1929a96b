"""``shardkit.optim.OSS`` (ZeRO-1), alone or with ``ShardedDataParallel`` (ZeRO-2) or torch DDP (full layout).

Saving consolidates the sharded optimizer state on rank 0 (``consolidate_state_dict(recipient_rank=0)``, a
collective, then ``state_dict()``): a plain ``torch.optim`` state dict, which ``OSS.load_state_dict`` re-shards at
any world size. Every rank holds the whole model, so rank 0 writes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.checkpoint.adapters.full import FullStateAdapter
from shardkit.checkpoint.adapters.registry import loaded_class


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
