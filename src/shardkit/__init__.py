"""shardkit: train PyTorch models that do not fit on one device, across many processes and machines.

Sub-packages, one per capability:

- :mod:`shardkit.optim` - ZeRO-1: :class:`~shardkit.optim.OSS` shards optimizer state,
  :class:`~shardkit.optim.ShardedGradScaler` does AMP loss scaling over sharded gradients.
- :mod:`shardkit.nn` - data-parallel wrappers: :class:`~shardkit.nn.ShardedDataParallel` (ZeRO-2) and the
  fully sharded and communication-efficient strategies.
- :mod:`shardkit.distributed` - process-group helpers and labelled collectives.
- :mod:`shardkit.models` - the reference models; :mod:`shardkit.strategies` - the strategy registry the tools run.
- :mod:`shardkit.testing` - a multi-process test harness (and the reference models, re-exported).

Importing ``shardkit`` itself is cheap; sub-packages are imported on first use.
"""

from shardkit.restarts import warn_if_restarts_will_fail as _warn_if_restarts_will_fail

__version__ = "0.1.0"

# A worker restarted by torchrun over the round before's store learns what to set before its process group fails.
_warn_if_restarts_will_fail()
