"""Compatibility path for fairscale's ``gossip.mixing_manager`` (see :mod:`shardkit.compat`)."""

from shardkit.nn.slowmo.mixing import MixingManager, UniformMixing

__all__ = ["MixingManager", "UniformMixing"]
