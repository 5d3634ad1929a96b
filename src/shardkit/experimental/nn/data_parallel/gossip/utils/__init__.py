"""Compatibility path for fairscale's ``gossip.utils``: ``communicate`` (its other helpers are internals of
fairscale's SlowMo; see :mod:`shardkit.compat`)."""

from shardkit.nn.slowmo.helpers import communicate

__all__ = ["communicate"]
