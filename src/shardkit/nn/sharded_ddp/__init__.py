"""ZeRO-2 data parallelism: gradients reduced only to the rank that owns their optimizer shard.

- :mod:`~shardkit.nn.sharded_ddp.api` - :class:`ShardedDataParallel`, the public wrapper.
- :mod:`~shardkit.nn.sharded_ddp.plan` - which gradients travel together (pure, rank-independent).
- :mod:`~shardkit.nn.sharded_ddp.reducer` - gradient hooks, asynchronous reduces, end-of-backward flush.
- :mod:`~shardkit.nn.sharded_ddp.startup` - rank-0 synchronisation at construction (after the shared same-model
  check of :mod:`shardkit.distributed.model_check`).
- :mod:`~shardkit.nn.sharded_ddp.comm` - coalesced broadcasts.
- :mod:`~shardkit.nn.sharded_ddp.state_dict` - checkpoint keys with the ``module.`` level (fairscale's and torch DDP's);
  loads both forms.
"""

from shardkit.nn.sharded_ddp.api import ShardedDataParallel
from shardkit.nn.sharded_ddp.policy import ReducePolicy, SyncPolicy
from shardkit.nn.sharded_ddp.reducer import RoundStats

__all__ = ["ReducePolicy", "RoundStats", "ShardedDataParallel", "SyncPolicy"]
