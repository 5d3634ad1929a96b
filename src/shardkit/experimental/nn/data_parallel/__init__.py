"""fairscale's ``fairscale.experimental.nn.data_parallel`` path: SlowMo (its home is :mod:`shardkit.nn.slowmo`)."""

from shardkit.experimental.nn.data_parallel.gossip import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel

__all__ = ["SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel"]
