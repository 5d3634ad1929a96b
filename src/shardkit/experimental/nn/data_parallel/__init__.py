"""Compatibility path for ``fairscale.experimental.nn.data_parallel``: SlowMo, from :mod:`shardkit.nn.slowmo`
(see :mod:`shardkit.compat`)."""

from shardkit.nn.slowmo import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel

__all__ = ["SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel"]
