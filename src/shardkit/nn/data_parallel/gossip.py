"""SlowMo's gossip building blocks, also reachable beside the data-parallel wrappers.

fairscale keeps them under ``fairscale.experimental.nn.data_parallel.gossip``; shardkit's home for that path is
:mod:`shardkit.experimental.nn.data_parallel.gossip`. Tools that map fairscale's experimental data-parallel package
onto ``shardkit.nn.data_parallel`` find the same objects here.
"""

from shardkit.experimental.nn.data_parallel.gossip import (
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
