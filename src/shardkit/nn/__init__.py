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

# ``shardkit.nn.wrap`` is the package; it is callable as the ``wrap`` function (see its docstring), so both
# ``from shardkit.nn import wrap`` and ``from shardkit.nn.wrap import wrap`` give something that wraps.
from shardkit.nn.wrap import (
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    transformer_auto_wrap_policy,
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
