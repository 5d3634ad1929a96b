"""Compatibility path for fairscale's ``gossip.gossiper`` (see :mod:`shardkit.compat`)."""

from shardkit.nn.slowmo.gossipers import Gossiper, PushPull, PushSum

__all__ = ["Gossiper", "PushPull", "PushSum"]
