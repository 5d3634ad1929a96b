"""SlowMo data parallelism for slow networks: LocalSGD or Stochastic Gradient Push between nodes, plus slow momentum.

Files, one responsibility each: ``api`` (the public wrapper; ``arguments`` checks its constructor's arguments,
``state`` is its base class with the accessors and state-dict hooks), ``config`` (frozen settings), ``schedule`` (what
each step does), ``layout`` (nodes and process groups), ``graphs`` / ``mixing`` (gossip topology and weights),
``push_sum`` (the push-sum weight and parameter forms), ``gossip`` (gossip rounds), ``local_sgd`` (exact
averages), ``slow_momentum`` (the outer step), ``collectives`` (the labelled communication patterns);
``gossipers`` (fairscale's stand-alone ``PushSum``/``PushPull``) and ``helpers`` (``communicate``,
``CudaEventRecorder``) serve code written against fairscale's gossip package.

Example::

    from shardkit.nn.slowmo import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel

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
from shardkit.nn.slowmo.gossipers import PushPull, PushSum
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
from shardkit.nn.slowmo.helpers import CudaEventRecorder, communicate
from shardkit.nn.slowmo.mixing import MixingManager, MixingShares, UniformMixing
from shardkit.nn.slowmo.push_sum import ParamForm

__all__ = [
    "CudaEventRecorder",
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "Edge",
    "GossipConfig",
    "GraphManager",
    "LocalSGDConfig",
    "MixingManager",
    "MixingShares",
    "NPeerDynamicDirectedExponentialGraph",
    "ParamForm",
    "PushPull",
    "PushSum",
    "RingGraph",
    "SlowMoBaseAlgorithm",
    "SlowMoConfig",
    "SlowMoDistributedDataParallel",
    "SlowMomentumConfig",
    "UniformMixing",
    "WrapperConfig",
    "communicate",
]
