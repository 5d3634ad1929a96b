"""Compatibility path for ``fairscale.nn.data_parallel.fully_sharded_data_parallel``: the names fairscale users
import from it, from :mod:`shardkit.nn.fsdp` (see :mod:`shardkit.compat`)."""

from shardkit.nn.fsdp import FullyShardedDataParallel, ProcessGroupName, ShardingStrategy, TrainingState
from shardkit.nn.fsdp.helpers import auto_wrap_bn, get_fsdp_instances, no_pre_load_state_dict_hook

__all__ = [
    "FullyShardedDataParallel",
    "ProcessGroupName",
    "ShardingStrategy",
    "TrainingState",
    "auto_wrap_bn",
    "get_fsdp_instances",
    "no_pre_load_state_dict_hook",
]
