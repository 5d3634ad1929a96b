"""Compatibility path for ``fairscale.experimental.nn`` (see :mod:`shardkit.compat`)."""
