"""fairscale's import paths and fairscale-only objects, kept at the edge of shardkit.

shardkit's own modules are named for what they hold (:mod:`shardkit.optim.zero1`, :mod:`shardkit.nn.fsdp`,
:mod:`shardkit.nn.slowmo`, ...). fairscale users migrate by changing ``fairscale`` to ``shardkit`` in their imports,
so fairscale's module paths exist too: each module listed in :data:`COMPAT_PATHS` is a *compatibility path* that
only re-exports names from the core module owning them (one hop, never through another compatibility path) and
says so in the first line of its docstring. Objects that exist only for fairscale's API, such as
``FlattenParamsWrapper`` for ``isinstance`` checks and the ``fsdp_optim_utils`` helpers that name their
replacements, live in :mod:`shardkit.compat.fairscale`.

No core module imports a compatibility path or this package; ``tests/compat/test_compat_boundary.py`` checks that
from the source, and that every listed path is a thin re-export.

Where fairscale's path and shardkit's own package coincide (:mod:`shardkit.nn.wrap`, :mod:`shardkit.nn.checkpoint`,
:mod:`shardkit.optim.grad_scaler`, the top-level names of :mod:`shardkit.nn` and :mod:`shardkit.optim`), the core
module itself answers. smp's API is :mod:`shardkit.modelparallel` itself (``import shardkit.modelparallel as smp``):
it has no separate compatibility paths.
"""

#: Every compatibility path (shardkit module -> the fairscale module it stands for). Each only re-exports.
COMPAT_PATHS: dict[str, str] = {
    "shardkit.optim.oss": "fairscale.optim.oss",
    "shardkit.utils.testing": "fairscale.utils.testing (DummyProcessGroup, now fairscale.fair_dev.testing)",
    "shardkit.nn.data_parallel": "fairscale.nn.data_parallel",
    "shardkit.nn.data_parallel.sharded_ddp": "fairscale.nn.data_parallel.sharded_ddp",
    "shardkit.nn.data_parallel.fully_sharded_data_parallel": "fairscale.nn.data_parallel.fully_sharded_data_parallel",
    "shardkit.nn.data_parallel.fsdp_optim_utils": "fairscale.nn.data_parallel.fsdp_optim_utils",
    "shardkit.nn.data_parallel.gossip": "fairscale.experimental.nn.data_parallel.gossip (mapped onto data_parallel)",
    "shardkit.nn.misc": "fairscale.nn.misc",
    "shardkit.nn.misc.flatten_params_wrapper": "fairscale.nn.misc.flatten_params_wrapper",
    "shardkit.nn.checkpoint.checkpoint_activations": "fairscale.nn.checkpoint.checkpoint_activations",
    "shardkit.experimental": "fairscale.experimental",
    "shardkit.experimental.nn": "fairscale.experimental.nn",
    "shardkit.experimental.nn.data_parallel": "fairscale.experimental.nn.data_parallel",
    "shardkit.experimental.nn.data_parallel.gossip": "fairscale.experimental.nn.data_parallel.gossip",
    "shardkit.experimental.nn.data_parallel.gossip.distributed": "fairscale.experimental...gossip.distributed",
    "shardkit.experimental.nn.data_parallel.gossip.gossiper": "fairscale.experimental...gossip.gossiper",
    "shardkit.experimental.nn.data_parallel.gossip.graph_manager": "fairscale.experimental...gossip.graph_manager",
    "shardkit.experimental.nn.data_parallel.gossip.mixing_manager": "fairscale.experimental...gossip.mixing_manager",
    "shardkit.experimental.nn.data_parallel.gossip.utils": "fairscale.experimental...gossip.utils",
    "shardkit.experimental.nn.data_parallel.gossip.utils.cuda_metering": "fairscale.experimental...utils.cuda_metering",
}

__all__ = ["COMPAT_PATHS"]
