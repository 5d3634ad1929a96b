"""Compatibility path for ``fairscale.nn.data_parallel``: the wrappers from :mod:`shardkit.nn.fsdp`,
:mod:`shardkit.nn.sharded_ddp` and :mod:`shardkit.nn.slowmo` (see :mod:`shardkit.compat`)."""

from shardkit.nn.fsdp import FullyShardedDataParallel, ShardingStrategy, TrainingState
from shardkit.nn.fsdp.helpers import auto_wrap_bn, get_fsdp_instances, no_pre_load_state_dict_hook
from shardkit.nn.sharded_ddp import ShardedDataParallel
from shardkit.nn.slowmo import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel

__all__ = [
    "FullyShardedDataParallel",
    "ShardedDataParallel",
    "ShardingStrategy",
    "SlowMoBaseAlgorithm",
    "SlowMoDistributedDataParallel",
    "TrainingState",
    "auto_wrap_bn",
    "get_fsdp_instances",
    "no_pre_load_state_dict_hook",
]
