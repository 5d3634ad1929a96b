"""Hybrid data parallelism: state sharded inside a node, replicated across nodes.

OSS, ShardedDataParallel and FullyShardedDataParallel take the nodes the same way, as their group argument:

* an ``(intra_node_group, inter_node_group)`` pair (torch FSDP's ``HYBRID_SHARD`` spelling),
* a 2-D ``DeviceMesh`` (dim 0 across nodes, dim 1 inside a node, as ``init_device_mesh(dev, (nodes, per_node))``
  builds it), or
* a :class:`~shardkit.distributed.topology.Topology` (``Topology.from_env()`` reads torchrun's
  ``LOCAL_WORLD_SIZE``).

State is sharded over the intra-node group (fast links); what each shard owner computes is then all-reduced (or
broadcast) over the inter-node group, the ranks with the same local rank on the other nodes, so the slow network
carries shard-sized messages only. :func:`hybrid_topology` turns any of the three into a validated
:class:`Topology` (every rank raises the same error on a bad layout, before any change).

Example::

    topo = Topology.from_env()                                   # under torchrun --nnodes 2 --nproc-per-node 8
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, group=topo, lr=1e-3)
    model = ShardedDataParallel(model, optimizer)                # reduces inside the node, all-reduces across
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from shardkit.distributed.groups import GroupLike, group_size, resolve_group
from shardkit.distributed.topology import Topology

#: What the group arguments accept to mean "these nodes": a group pair, a 2-D DeviceMesh or a Topology.
HybridSpec = Union[tuple[GroupLike, GroupLike], Topology, Any]


def is_mesh(value: Any) -> bool:
    """True for a torch ``DeviceMesh``."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without device meshes
        return False
    return isinstance(value, DeviceMesh)


def is_hybrid_spec(value: Any) -> bool:
    """True when ``value`` describes nodes (pair, Topology or a DeviceMesh of 2+ dimensions)."""
    if isinstance(value, (Topology, tuple, list)):
        return True
    return is_mesh(value) and value.ndim != 1


def mesh_group(value: Any) -> Any:
    """The process group of a 1-D ``DeviceMesh`` (torch FSDP takes one as its group); other values unchanged."""
    if is_mesh(value) and value.ndim == 1:
        return value.get_group(0)
    return value


def hybrid_topology(spec: HybridSpec, who: str) -> Topology:
    """The validated :class:`Topology` that ``spec`` describes; call on every rank (it may all-gather once)."""
    if isinstance(spec, Topology):
        return spec
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise ValueError(
                f"{who}: a group pair must be (intra_node_group, inter_node_group), got {len(spec)} entries"
            )
        return Topology.from_groups(spec[0], spec[1])
    if is_mesh(spec):
        return Topology.from_mesh(spec)
    raise TypeError(
        f"{who}: expected an (intra_node_group, inter_node_group) pair, a 2-D DeviceMesh or a Topology, "
        f"got {type(spec).__name__}"
    )


def shard_and_replica(spec: Any, who: str, argument: str = "process_group") -> tuple[GroupLike, Optional[GroupLike]]:
    """``(group to shard over, group to replicate over or None)`` for ``who``'s group ``argument``: a single group
    (or None for the world) shards over it with no replicas; a node description shards inside the node and
    replicates across nodes (no replica group when there is one node)."""
    if not is_hybrid_spec(spec):
        return resolve_group(mesh_group(spec), who, argument), None
    topo = hybrid_topology(spec, who)
    return topo.intra_group, (topo.inter_group if group_size(topo.inter_group) > 1 else None)


def agree_across_nodes(
    check: Callable[[GroupLike, Optional[Exception]], None],
    group: GroupLike,
    replica: Optional[GroupLike],
    local_error: Optional[Exception],
) -> None:
    """Run a raise-on-every-member agreement ``check(group, local_error)`` over ``replica``, then over ``group``.

    A refusal on any rank then raises on every rank of both: the second check carries what the first raised, so
    no rank is left waiting in a collective its peers skipped.
    """
    if replica is not None:
        try:
            check(replica, local_error)
        except Exception as exc:  # carried into the shard group's check, which raises it on every member
            local_error = exc
    check(group, local_error)
