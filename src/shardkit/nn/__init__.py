"""Data-parallel wrappers, wrapping helpers and activation checkpointing.

- :class:`ShardedDataParallel` (ZeRO-2), :class:`FullyShardedDataParallel` (ZeRO-3),
  :class:`SlowMoDistributedDataParallel` (SlowMo, LocalSGD, SGP);
- :mod:`shardkit.nn.wrap` (``enable_wrap``, ``wrap``, ``auto_wrap``) and :func:`checkpoint_wrapper`.

The Lightning integration lives in :mod:`shardkit.lightning` and is never imported from here.
"""

from shardkit.nn.checkpoint import apply_activation_checkpointing, checkpoint_wrapper
from shardkit.nn.fsdp import BackwardPrefetch, CPUOffload, FullyShardedDataParallel, ShardingStrategy
from shardkit.nn.sharded_ddp import ShardedDataParallel
from shardkit.nn.slowmo import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel

# Imported last, so the name ``wrap`` here is the function (as in fairscale), not the package ``shardkit.nn.wrap``
# that importing it binds first: ``from shardkit.nn import wrap`` gives the function.
from shardkit.nn.wrap import (
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullyShardedDataParallel",
    "ShardedDataParallel",
    "ShardingStrategy",
    "SlowMoBaseAlgorithm",
    "SlowMoDistributedDataParallel",
    "apply_activation_checkpointing",
    "auto_wrap",
    "checkpoint_wrapper",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "transformer_auto_wrap_policy",
    "wrap",
]
