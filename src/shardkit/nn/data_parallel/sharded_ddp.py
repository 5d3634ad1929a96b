"""Compatibility path for fairscale users: ``from shardkit.nn.data_parallel.sharded_ddp import ShardedDataParallel``."""

from shardkit.nn.sharded_ddp import ShardedDataParallel

__all__ = ["ShardedDataParallel"]
