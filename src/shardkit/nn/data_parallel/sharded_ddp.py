"""Compatibility path for ``fairscale.nn.data_parallel.sharded_ddp`` (see :mod:`shardkit.compat`)."""

from shardkit.nn.sharded_ddp import ShardedDataParallel

__all__ = ["ShardedDataParallel"]
