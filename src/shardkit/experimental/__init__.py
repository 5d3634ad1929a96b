"""Compatibility path for ``fairscale.experimental`` (see :mod:`shardkit.compat`)."""
