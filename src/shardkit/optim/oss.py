"""Compatibility path for ``fairscale.optim.oss``: :class:`~shardkit.optim.zero1.OSS` (see :mod:`shardkit.compat`)."""

from shardkit.optim.zero1 import OSS

__all__ = ["OSS"]
