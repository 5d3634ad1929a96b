"""SlowMo data parallelism for slow networks: LocalSGD or Stochastic Gradient Push between nodes, plus slow momentum.

Files, one responsibility each: ``api`` (the public wrapper), ``config`` (frozen settings), ``schedule`` (what
each step does), ``layout`` (nodes and process groups), ``graphs`` / ``mixing`` (gossip topology and weights),
``push_sum`` (the push-sum weight and parameter forms), ``gossip`` (gossip rounds), ``local_sgd`` (exact
averages), ``slow_momentum`` (the outer step), ``collectives`` (the labelled communication patterns).

Example::

    from shardkit.nn.data_parallel import SlowMoDistributedDataParallel, SlowMoBaseAlgorithm

    net = SlowMoDistributedDataParallel(model, nprocs_per_node=8, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP)
    loss_fn(net(x), y).backward()
    optimizer.step()
    net.perform_slowmo(optimizer)
"""

from shardkit.nn.slowmo.api import SlowMoDistributedDataParallel
from shardkit.nn.slowmo.config import (
    GossipConfig,
    LocalSGDConfig,
    SlowMoBaseAlgorithm,
    SlowMoConfig,
    SlowMomentumConfig,
    WrapperConfig,
)
from shardkit.nn.slowmo.graphs import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    GraphManager,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)
from shardkit.nn.slowmo.mixing import MixingManager, MixingShares, UniformMixing
from shardkit.nn.slowmo.push_sum import ParamForm
from shardkit.nn.slowmo.schedule import StepPlan, plan_step

__all__ = [
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "GossipConfig",
    "GraphManager",
    "LocalSGDConfig",
    "MixingManager",
    "MixingShares",
    "NPeerDynamicDirectedExponentialGraph",
    "ParamForm",
    "RingGraph",
    "SlowMoBaseAlgorithm",
    "SlowMoConfig",
    "SlowMoDistributedDataParallel",
    "SlowMomentumConfig",
    "StepPlan",
    "UniformMixing",
    "WrapperConfig",
    "plan_step",
]
