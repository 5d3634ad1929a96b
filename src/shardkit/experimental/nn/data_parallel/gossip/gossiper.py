"""fairscale's ``gossip.gossiper`` path."""

from shardkit.nn.slowmo.gossipers import Gossiper, PushPull, PushSum

__all__ = ["Gossiper", "PushPull", "PushSum"]
