"""Choosing and checking the gossip graph and mixing for SGP, before anything is built."""

from __future__ import annotations

import warnings
from typing import Optional

from shardkit.nn.slowmo.config import SlowMoBaseAlgorithm
from shardkit.nn.slowmo.graphs import GraphManager, NPeerDynamicDirectedExponentialGraph
from shardkit.nn.slowmo.layout import ProcessLayout
from shardkit.nn.slowmo.mixing import MixingManager, UniformMixing


def resolve_topology(
    algorithm: SlowMoBaseAlgorithm,
    layout: ProcessLayout,
    graph: Optional[GraphManager],
    mixing: Optional[MixingManager],
    push_sum: bool,
) -> Optional[tuple[GraphManager, MixingManager]]:
    """The (graph, mixing) pair SGP gossips with, or None when there is no gossip.

    Defaults: :class:`NPeerDynamicDirectedExponentialGraph` with one peer per round and :class:`UniformMixing`.
    Raises on combinations that cannot work; warns when a graph or mixing is given but unused.
    """
    if graph is not None and not isinstance(graph, GraphManager):
        raise TypeError(f"graph must be a shardkit.nn.slowmo GraphManager, got {type(graph).__name__}")
    if mixing is not None and not isinstance(mixing, MixingManager):
        raise TypeError(f"mixing must be a shardkit.nn.slowmo MixingManager, got {type(mixing).__name__}")
    if mixing is not None and graph is not None and mixing.graph_manager is not graph:
        raise ValueError(
            "mixing was built over a different graph than the one passed as graph; build it as "
            "UniformMixing(graph) with the same graph object"
        )
    if algorithm is not SlowMoBaseAlgorithm.SGP or layout.num_nodes == 1:
        if graph is not None or mixing is not None:
            why = "LocalSGD does not gossip" if algorithm is not SlowMoBaseAlgorithm.SGP else "there is only one node"
            warnings.warn(f"graph and mixing are ignored: {why}", UserWarning, stacklevel=4)
        return None
    if graph is None:
        graph = mixing.graph_manager if mixing is not None else None
    if graph is None:
        graph = NPeerDynamicDirectedExponentialGraph(
            layout.node_rank, layout.num_nodes, layout.nprocs_per_node, layout.local_rank
        )
    if graph.world_size != layout.num_nodes or graph.rank != layout.node_rank:
        raise ValueError(
            f"{graph!r} does not match this job: gossip runs between {layout.num_nodes} nodes and this process is on "
            f"node {layout.node_rank}; build the graph with rank=process_rank // nprocs_per_node and "
            "world_size=world_size // nprocs_per_node"
        )
    mixing = mixing if mixing is not None else UniformMixing(graph)
    if not push_sum and not mixing.is_regular():
        reason = "mixing is not uniform" if not mixing.is_uniform() else f"{graph!r} is not regular"
        raise ValueError(
            f"push_sum=False (push-pull gossip) needs doubly stochastic mixing, i.e. uniform mixing on a regular "
            f"graph, but {reason}. Use push_sum=True (push-sum corrects the bias with a weight), or a regular graph."
        )
    return graph, mixing
