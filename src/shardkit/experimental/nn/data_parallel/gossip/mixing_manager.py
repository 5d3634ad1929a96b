"""fairscale's ``gossip.mixing_manager`` path."""

from shardkit.nn.slowmo.mixing import MixingManager, UniformMixing

__all__ = ["MixingManager", "UniformMixing"]
