"""Optimizer-state sharding (ZeRO-1) and AMP loss scaling for sharded gradients."""

from shardkit.optim.grad_scaler import GradScaler, ShardedGradScaler
from shardkit.optim.zero1 import OSS

__all__ = ["OSS", "GradScaler", "ShardedGradScaler"]
