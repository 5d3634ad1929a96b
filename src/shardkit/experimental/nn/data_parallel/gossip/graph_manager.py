"""Compatibility path for fairscale's ``gossip.graph_manager`` (see :mod:`shardkit.compat`)."""

from shardkit.nn.slowmo.graphs import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    Edge,
    GraphManager,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)

__all__ = [
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "Edge",
    "GraphManager",
    "NPeerDynamicDirectedExponentialGraph",
    "RingGraph",
]
