"""PyTorch Lightning 2.x strategies for shardkit (optional: ``pip install shardkit[lightning]``).

- :class:`DDPFullyShardedStrategy` (alias :class:`FullyShardedStrategy`): parameters, gradients and optimizer
  state sharded with :class:`~shardkit.nn.FullyShardedDataParallel` (ZeRO-3), auto-wrapping by size or block
  class, activation checkpointing, CPU offload, mixed precision.
- :class:`DDPShardedStrategy`: optimizer state and gradients sharded with :class:`~shardkit.optim.OSS` and
  :class:`~shardkit.nn.ShardedDataParallel` (ZeRO-2).

Importing this module registers both in Lightning's strategy registry as ``"shardkit_fsdp"`` and
``"shardkit_sharded"``. Either pass a strategy instance, or import ``shardkit.lightning`` before building the
Trainer with the name::

    import shardkit.lightning  # noqa: F401  (registers the names)
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="gpu", devices=4, strategy="shardkit_fsdp", precision="bf16-mixed")

The core ``shardkit`` package never imports Lightning; only this sub-package does.
"""

from __future__ import annotations

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "shardkit.lightning needs PyTorch Lightning 2.x: pip install 'shardkit[lightning]' (or pip install lightning)"
    ) from exc

from shardkit.lightning.fully_sharded import DDPFullyShardedStrategy, FullyShardedStrategy
from shardkit.lightning.sharded import DDPShardedStrategy

DDPFullyShardedStrategy.register_strategies(StrategyRegistry)
DDPShardedStrategy.register_strategies(StrategyRegistry)

__all__ = ["DDPFullyShardedStrategy", "DDPShardedStrategy", "FullyShardedStrategy"]
