"""Which ranks a unit shards over and which hold its replicas, from ``process_group`` and ``sharding_strategy``.

A unit has a *shard group* (its parameters are split over it: ``process_group``, ``world_size`` and the state
dicts use it) and, for hybrid sharding and ``NO_SHARD``, a *replica group* (the ranks holding the same shard:
each reduced gradient shard is all-reduced over it):

=======================  ==================================  ====================================
strategy                 shard group                         replica group
=======================  ==================================  ====================================
FULL_SHARD/SHARD_GRAD_OP ``process_group`` (default: world)  none
HYBRID_SHARD, _ZERO2     the node (intra-node group)         same local rank on the other nodes
NO_SHARD                 this rank alone                     ``process_group`` (default: world)
=======================  ==================================  ====================================

The nodes come from ``process_group`` when it is an ``(intra, inter)`` pair, a 2-D ``DeviceMesh`` or a
:class:`~shardkit.distributed.topology.Topology`, else from torchrun's ``LOCAL_WORLD_SIZE`` over
``process_group`` (:meth:`Topology.from_env`). Groups are created once per layout and shared by every unit.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from shardkit.distributed.groups import GroupLike, group_size, resolve_group
from shardkit.distributed.hybrid import agree_across_nodes, hybrid_topology, is_hybrid_spec, is_mesh, mesh_group
from shardkit.distributed.model_check import check_same_model
from shardkit.distributed.topology import Topology
from shardkit.nn.fsdp.policies import FSDPPolicies, policies_from_args
from shardkit.nn.fsdp.reduce_channels import resolve_reduce_group
from shardkit.nn.fsdp.strategy import ShardingStrategy
from shardkit.tensor_parallel import check_data_parallel_group

_WHO = "FullyShardedDataParallel"


def resolve_unit(module: nn.Module, process_group: Any, settings: dict[str, Any]) -> tuple[GroupLike, FSDPPolicies]:
    """A new unit's shard group and frozen policies, from the constructor's ``process_group`` and other
    arguments (``settings``); where there are replicas, they must hold the same model. Raises on every rank
    before anything changes."""
    strategy, reshard = settings["sharding_strategy"], settings["reshard_after_forward"]
    group, replica_group, strategy = resolve_unit_groups(process_group, strategy, reshard)
    policies = policies_from_args({**settings, "sharding_strategy": strategy, "replica_group": replica_group})
    policies = resolve_reduce_group(policies, group)
    groups = (group,) if replica_group is None else (group, replica_group)
    check_data_parallel_group(module.parameters(), groups, _WHO)  # a TP model: never shard across its TP ranks
    if replica_group is not None:
        agree_across_nodes(
            lambda g, err: check_same_model(module, g, _WHO, local_error=err), group, replica_group, None
        )
    return group, policies


def resolve_unit_groups(
    process_group: Any, strategy: Optional[ShardingStrategy], reshard_after_forward: bool
) -> tuple[GroupLike, Optional[GroupLike], Optional[ShardingStrategy]]:
    """``(shard group, replica group or None, strategy)``; a node description without a strategy means hybrid.

    Raises (on every rank, before any change) for a strategy that is not a :class:`ShardingStrategy`, nodes
    given with a strategy that does not use them, and node layouts that do not tile the world.
    """
    if strategy is not None and not isinstance(strategy, ShardingStrategy):
        names = ", ".join(f"ShardingStrategy.{s.name}" for s in ShardingStrategy)
        raise TypeError(f"sharding_strategy must be one of {names} (or None), got {strategy!r}")
    if strategy is not None and strategy.is_hybrid and is_mesh(process_group) and process_group.ndim != 2:
        raise ValueError(
            f"sharding_strategy=ShardingStrategy.{strategy.name} takes a 2-D DeviceMesh of shape (num_nodes, "
            f"nprocs_per_node) (dim 0 across nodes, dim 1 inside a node), got one of shape "
            f"{list(process_group.mesh.shape)}: build it with init_device_mesh(device, (num_nodes, nprocs_per_node))"
        )
    process_group = mesh_group(process_group)
    nodes_given = is_hybrid_spec(process_group)
    if nodes_given and strategy is None:
        strategy = ShardingStrategy["HYBRID_SHARD" if reshard_after_forward else "_HYBRID_SHARD_ZERO2"]
    if nodes_given:
        assert strategy is not None
        if not strategy.is_hybrid:
            raise ValueError(
                f"process_group describes nodes (a group pair, 2-D DeviceMesh or Topology), but "
                f"sharding_strategy=ShardingStrategy.{strategy.name} shards over one group: pass "
                "ShardingStrategy.HYBRID_SHARD (or _HYBRID_SHARD_ZERO2) with it, or a single process group"
            )
        topo = hybrid_topology(process_group, _WHO)
    elif strategy is not None and strategy.is_hybrid:
        topo = Topology.from_env(resolve_group(process_group, _WHO))
    elif strategy is ShardingStrategy.NO_SHARD:
        topo = Topology.from_env(resolve_group(process_group, _WHO), nprocs_per_node=1)
    else:
        return resolve_group(process_group, _WHO), None, strategy
    replica = topo.inter_group if group_size(topo.inter_group) > 1 else None
    return topo.intra_group, replica, strategy
