"""Compatibility path for ``fairscale.experimental.nn.data_parallel.gossip``: SlowMo and its gossip building blocks
from :mod:`shardkit.nn.slowmo` (see :mod:`shardkit.compat`).

Code written for fairscale runs after changing the import::

    import shardkit.experimental.nn.data_parallel.gossip as gossip

    net = gossip.SlowMoDistributedDataParallel(model, nprocs_per_node=1, graph=gossip.RingGraph(rank, world))

fairscale's submodules (``distributed``, ``gossiper``, ``graph_manager``, ``mixing_manager``, ``utils``) exist too.
"""

from shardkit.nn.slowmo import (
    CudaEventRecorder,
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    GraphManager,
    MixingManager,
    NPeerDynamicDirectedExponentialGraph,
    PushPull,
    PushSum,
    RingGraph,
    SlowMoBaseAlgorithm,
    SlowMoDistributedDataParallel,
    UniformMixing,
    communicate,
)

__all__ = [
    "CudaEventRecorder",
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "GraphManager",
    "MixingManager",
    "NPeerDynamicDirectedExponentialGraph",
    "PushPull",
    "PushSum",
    "RingGraph",
    "SlowMoBaseAlgorithm",
    "SlowMoDistributedDataParallel",
    "UniformMixing",
    "communicate",
]
