"""Compatibility path for fairscale users: ``from shardkit.optim.oss import OSS``."""

from shardkit.optim.zero1.optimizer import OSS

__all__ = ["OSS"]
