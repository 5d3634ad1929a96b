"""Compatibility path for fairscale's ``gossip.distributed`` (see :mod:`shardkit.compat`)."""

from shardkit.nn.slowmo.api import SlowMoDistributedDataParallel
from shardkit.nn.slowmo.config import SlowMoBaseAlgorithm

__all__ = ["SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel"]
