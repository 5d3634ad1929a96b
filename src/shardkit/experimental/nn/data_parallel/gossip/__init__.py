"""fairscale's ``fairscale.experimental.nn.data_parallel.gossip`` path, re-exporting :mod:`shardkit.nn.slowmo`.

Code written for fairscale runs after changing the import::

    import shardkit.experimental.nn.data_parallel.gossip as gossip

    net = gossip.SlowMoDistributedDataParallel(model, nprocs_per_node=1, graph=gossip.RingGraph(rank, world))

fairscale's submodules (``distributed``, ``gossiper``, ``graph_manager``, ``mixing_manager``, ``utils``) exist too.
"""

from shardkit.nn.slowmo.api import SlowMoDistributedDataParallel
from shardkit.nn.slowmo.config import SlowMoBaseAlgorithm
from shardkit.nn.slowmo.gossipers import PushPull, PushSum
from shardkit.nn.slowmo.graphs import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    GraphManager,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)
from shardkit.nn.slowmo.helpers import CudaEventRecorder, communicate
from shardkit.nn.slowmo.mixing import MixingManager, UniformMixing

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
