"""Compatibility path: fairscale kept SlowMo under ``experimental``; shardkit's lives in ``shardkit.nn.slowmo``."""

from shardkit.nn.slowmo import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel

__all__ = ["SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel"]
