"""fairscale's ``gossip.distributed`` path."""

from shardkit.nn.slowmo.api import SlowMoDistributedDataParallel
from shardkit.nn.slowmo.config import SlowMoBaseAlgorithm

__all__ = ["SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel"]
