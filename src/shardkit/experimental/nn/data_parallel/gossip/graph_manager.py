"""fairscale's ``gossip.graph_manager`` path."""

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
