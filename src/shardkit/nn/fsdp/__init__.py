"""ZeRO-3 fully sharded data parallel.

Layers, outermost first: :mod:`~shardkit.nn.fsdp.api` (the public class, arguments → policies, delegating to the
modules that do the work: :mod:`~shardkit.nn.fsdp.forward_methods` runs forward, :mod:`~shardkit.nn.fsdp.full_params`
summons full parameters, :mod:`~shardkit.nn.fsdp.state_dict` gives full, local, DCP-sharded and optimizer
state), :mod:`~shardkit.nn.fsdp.unit_module` (what a unit is: its run-time state through
``fsdp_unit``, fairscale's settings, clean names and the one module walker),
:mod:`~shardkit.nn.fsdp.runtime` (lifecycle hooks and the :class:`TrainingState` machine),
:mod:`~shardkit.nn.fsdp.prefetch` (the root's schedule: recorded order, rate-limited prefetch),
:mod:`~shardkit.nn.fsdp.param_group` (one unit: shard, gather, free, reduce),
:mod:`~shardkit.nn.fsdp.handle` (one flat parameter at run time), :mod:`~shardkit.nn.fsdp.flat_param`
(the layout metadata), :mod:`~shardkit.nn.fsdp.reduce` (gradient reduction in flight and its queue),
:mod:`~shardkit.nn.fsdp.reduce_channels` and :mod:`~shardkit.nn.fsdp.comm_context` (reduce channels, CUDA side
streams) and :mod:`~shardkit.nn.fsdp._collectives` (over :mod:`shardkit.distributed.collectives`). The layout
types (:class:`~shardkit.nn.fsdp.flat_param.FlatParamMeta` and its parts) are internals, read through
``FullyShardedDataParallel.flat_param_metas``.

Reading a wrapped model's shards (which original parameter lives in which flat range of which unit, on which
rank): :func:`layout` returns one frozen view (:mod:`~shardkit.nn.fsdp.shard_layout`); ``summon_full_params()``
is the one context that shows full parameters. The state dicts, the checkpoint adapters and the Lightning
checkpoint code read FSDP through these two only::

    view = layout(model)
    for flat in view.flats:
        print(flat.key, flat.fqns, flat.padding, flat.pieces(rank=0))

Fast settings (prefetch one unit ahead in both directions; ``BACKWARD_PRE`` costs at most one unit's full
parameters of extra memory)::

    block = FSDP(block, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True)

Hybrid sharding (:mod:`~shardkit.nn.fsdp.strategy`, :mod:`~shardkit.nn.fsdp.hybrid`): shard inside each node,
all-reduce gradient shards across nodes::

    model = FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
"""

from shardkit.nn.fsdp.api import FullyShardedDataParallel
from shardkit.nn.fsdp.forward_methods import register_fsdp_forward_method
from shardkit.nn.fsdp.helpers import auto_wrap_bn, get_fsdp_instances, no_pre_load_state_dict_hook
from shardkit.nn.fsdp.policies import BackwardPrefetch, CPUOffload, ProcessGroupName
from shardkit.nn.fsdp.runtime import TrainingState
from shardkit.nn.fsdp.shard_layout import ShardLayout, layout
from shardkit.nn.fsdp.strategy import ShardingStrategy
from shardkit.nn.wrap.context import register_default_wrapper

FSDP = FullyShardedDataParallel

# enable_wrap() without wrapper_cls wraps with FSDP; shardkit.nn.wrap sits below FSDP and does not import it.
register_default_wrapper(FullyShardedDataParallel)

__all__ = [
    "FSDP",
    "BackwardPrefetch",
    "CPUOffload",
    "FullyShardedDataParallel",
    "ProcessGroupName",
    "ShardLayout",
    "ShardingStrategy",
    "TrainingState",
    "auto_wrap_bn",
    "get_fsdp_instances",
    "layout",
    "no_pre_load_state_dict_hook",
    "register_fsdp_forward_method",
]
