"""fairscale's ``gossip.utils`` path: ``communicate`` (its other helpers are internals of fairscale's SlowMo)."""

from shardkit.nn.slowmo.helpers import communicate

__all__ = ["communicate"]
