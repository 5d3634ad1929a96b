"""Compatibility path for ``fairscale.experimental.nn.data_parallel.gossip`` beside the data-parallel wrappers
(tools that map fairscale's experimental data-parallel package onto ``shardkit.nn.data_parallel`` look here); the
same names as :mod:`shardkit.experimental.nn.data_parallel.gossip`, from :mod:`shardkit.nn.slowmo` (see
:mod:`shardkit.compat`)."""

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
