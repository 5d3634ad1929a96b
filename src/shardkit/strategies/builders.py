"""How each registered strategy wraps a model and builds its optimizer (see :mod:`.options` for the contract).

Every builder checks its options against the constructor it calls before building anything, and imports the
strategy's package only when it runs: the process that merely lists or selects strategies stays light, and a
strategy whose package has not landed is reported by the registry instead of breaking the import.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

from shardkit.strategies.options import (
    Built,
    OptimizerSpec,
    OptionError,
    check_options,
    enum_option,
    hybrid_topology,
    nothing,
    split_nested,
)

Group = Any  # a torch.distributed ProcessGroup or None (the default group): passed straight to the wrapper


def _with_group(options: dict[str, Any], key: str, group: Group) -> dict[str, Any]:
    """``options`` with ``key=group`` added when a group is given (else the wrapper's default group)."""
    return {**options, key: group} if group is not None else options


def build_ddp(model: nn.Module, optim: OptimizerSpec, group: Group, options: dict[str, Any], topology: Any) -> Built:
    """torch ``DistributedDataParallel(model, **options)`` and the plain optimizer."""
    from torch.nn.parallel import DistributedDataParallel

    check_options("ddp", DistributedDataParallel.__init__, options)
    wrapped = DistributedDataParallel(model, **_with_group(options, "process_group", group))
    return wrapped, optim.make(optim.params(wrapped)), nothing


def build_zero_torch(
    model: nn.Module, optim: OptimizerSpec, group: Group, options: dict[str, Any], topology: Any
) -> Built:
    """torch DDP, and torch's ``ZeroRedundancyOptimizer`` over the optimizer (``options``: DDP's)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    check_options("zero_torch", DistributedDataParallel.__init__, options)
    wrapped = DistributedDataParallel(model, **_with_group(options, "process_group", group))
    sharded = ZeroRedundancyOptimizer(
        optim.params(wrapped), optimizer_class=optim.cls, **_with_group({}, "process_group", group), **optim.kwargs
    )
    return wrapped, sharded, nothing


def _oss_options(
    name: str, wrapper_init: Any, options: dict[str, Any], group: Group, topology: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The wrapper's options and OSS's (``options["oss"]``), both checked; OSS shards over ``group``, or inside
    the node when hybrid (ShardedDataParallel then reduces over OSS's group by default)."""
    # start-up cost: a strategy's package (and torch._dynamo) is imported only by the process that builds it
    from shardkit.optim import OSS

    wrapper_opts, oss_opts = split_nested(options, "oss")
    nodes = hybrid_topology(name, wrapper_opts, topology)
    check_options(name, wrapper_init, wrapper_opts, ("oss",))
    check_options(f"{name} (oss=...)", OSS.__init__, oss_opts)
    return wrapper_opts, _with_group(oss_opts, "group", nodes if nodes is not None else group)


def build_oss_ddp(
    model: nn.Module, optim: OptimizerSpec, group: Group, options: dict[str, Any], topology: Any
) -> Built:
    """torch DDP and shardkit OSS (ZeRO-1); OSS's own options under ``options["oss"]``."""
    from torch.nn.parallel import DistributedDataParallel

    # start-up cost: a strategy's package (and torch._dynamo) is imported only by the process that builds it
    from shardkit.optim import OSS

    ddp_opts, oss_opts = _oss_options("oss_ddp", DistributedDataParallel.__init__, options, group, topology)
    wrapped = DistributedDataParallel(model, **_with_group(ddp_opts, "process_group", group))
    return wrapped, OSS(optim.params(wrapped), optim=optim.cls, **oss_opts, **optim.kwargs), nothing


def build_oss_sdp(
    model: nn.Module, optim: OptimizerSpec, group: Group, options: dict[str, Any], topology: Any
) -> Built:
    """shardkit OSS and ShardedDataParallel (ZeRO-2); OSS's own options under ``options["oss"]``."""
    # start-up cost: a strategy's package (and torch._dynamo) is imported only by the process that builds it
    from shardkit.nn import ShardedDataParallel
    from shardkit.optim import OSS

    sdp_opts, oss_opts = _oss_options("oss_sdp", ShardedDataParallel.__init__, options, group, topology)
    sharded = OSS(optim.params(model), optim=optim.cls, **oss_opts, **optim.kwargs)
    return ShardedDataParallel(model, sharded, **sdp_opts), sharded, nothing


def block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of the modules held in ``model``'s ``nn.ModuleList``s: a transformer's blocks."""
    return {type(child) for module in model.modules() if isinstance(module, nn.ModuleList) for child in module}


def _fsdp_options(options: dict[str, Any], group: Group, topology: Any) -> dict[str, Any]:
    """FSDP's options checked, enum names resolved, and the process group (the nodes for hybrid sharding)."""
    # start-up cost: a strategy's package (and torch._dynamo) is imported only by the process that builds it
    from shardkit.nn import FullyShardedDataParallel, ShardingStrategy
    from shardkit.nn.fsdp import BackwardPrefetch

    fsdp_opts = dict(options)
    check_options("fsdp", FullyShardedDataParallel.__init__, fsdp_opts, ("auto_wrap_policy",))
    enum_option(fsdp_opts, "sharding_strategy", ShardingStrategy, "fsdp")
    enum_option(fsdp_opts, "backward_prefetch", BackwardPrefetch, "fsdp")
    if "HYBRID" in str(fsdp_opts.get("sharding_strategy", "")).upper() and "process_group" not in fsdp_opts:
        if topology is None:
            raise OptionError("fsdp with a hybrid sharding_strategy needs nprocs_per_node (the ranks of one node)")
        fsdp_opts["process_group"] = topology
    return _with_group(fsdp_opts, "process_group", group) if "process_group" not in fsdp_opts else fsdp_opts


def build_fsdp(model: nn.Module, optim: OptimizerSpec, group: Group, options: dict[str, Any], topology: Any) -> Built:
    """shardkit FSDP: one unit per block (``auto_wrap_policy="blocks"``, the default) or as the given policy
    wraps (``None``: the root only), then the root; every unit takes the same options."""
    # start-up cost: a strategy's package (and torch._dynamo) is imported only by the process that builds it
    from shardkit.nn import FullyShardedDataParallel
    from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy

    fsdp_opts = dict(options)
    policy = fsdp_opts.pop("auto_wrap_policy", "blocks")
    fsdp_opts = _fsdp_options(fsdp_opts, group, topology)
    if policy == "blocks":  # the default: one unit per block of every ModuleList (a transformer's layers)
        classes = block_classes(model)
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes) if classes else None
    if policy is not None:
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **fsdp_opts):
            model = auto_wrap(model, auto_wrap_policy=policy)
    wrapped = FullyShardedDataParallel(model, **fsdp_opts)
    return wrapped, optim.make(optim.params(wrapped)), nothing


def build_slowmo(model: nn.Module, optim: OptimizerSpec, group: Group, options: dict[str, Any], topology: Any) -> Built:
    """shardkit SlowMo DDP (``nprocs_per_node`` from the topology, else 1); ``after_step`` runs its slow step."""
    # start-up cost: a strategy's package (and torch._dynamo) is imported only by the process that builds it
    from shardkit.nn.slowmo import SlowMoDistributedDataParallel

    per_node = topology.nprocs_per_node if topology is not None else 1
    slowmo_opts = {"nprocs_per_node": per_node, **options}
    check_options("slowmo", SlowMoDistributedDataParallel.__init__, slowmo_opts)
    if "global_group" not in slowmo_opts:
        slowmo_opts = _with_group(slowmo_opts, "global_group", group)
    wrapped = SlowMoDistributedDataParallel(model, **slowmo_opts)
    optimizer = optim.make(optim.params(wrapped))
    return wrapped, optimizer, functools.partial(wrapped.perform_slowmo, optimizer)


def _wrap_blocks(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Wrap every transformer block of ``model`` (a ``TransformerLM``), then the root, with ``wrap``."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"torch FSDP strategies expect a TransformerLM with a .blocks ModuleList, got {type(model)}")
    for index, block in enumerate(blocks):
        blocks[index] = wrap(block)
    return wrap(model)


def build_torch_fsdp2(
    model: nn.Module, optim: OptimizerSpec, group: Group, options: dict[str, Any], topology: Any
) -> Built:
    """torch ``fully_shard`` (FSDP2) per block of a ``TransformerLM``, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    check_options("torch_fsdp2", fully_shard, options, ())
    device_type = next(model.parameters()).device.type
    world: Any = group if group is not None else dist.group.WORLD
    mesh = DeviceMesh.from_group(world, device_type)

    def wrap(module: nn.Module) -> nn.Module:
        fully_shard(module, mesh=mesh, **options)
        return module

    wrapped = _wrap_blocks(model, wrap)
    return wrapped, optim.make(optim.params(wrapped)), nothing


def build_torch_fsdp1(
    model: nn.Module, optim: OptimizerSpec, group: Group, options: dict[str, Any], topology: Any
) -> Built:
    """torch ``FullyShardedDataParallel`` (FSDP1) per block of a ``TransformerLM``, then the root."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    check_options("torch_fsdp1", FullyShardedDataParallel.__init__, options)
    device = next(model.parameters()).device
    fsdp_opts = _with_group({"device_id": device, **options}, "process_group", group)

    def wrap(module: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(module, **fsdp_opts)

    wrapped = _wrap_blocks(model, wrap)
    return wrapped, optim.make(optim.params(wrapped)), nothing
