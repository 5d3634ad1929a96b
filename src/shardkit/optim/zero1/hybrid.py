"""Compatibility path: the hybrid-sharding helpers moved to :mod:`shardkit.distributed.hybrid` (OSS,
ShardedDataParallel and FSDP all use them); this module re-exports them."""

from shardkit.distributed.hybrid import (
    HybridSpec,
    agree_across_nodes,
    hybrid_topology,
    is_hybrid_spec,
    is_mesh,
    mesh_group,
    shard_and_replica,
)

__all__ = [
    "HybridSpec",
    "agree_across_nodes",
    "hybrid_topology",
    "is_hybrid_spec",
    "is_mesh",
    "mesh_group",
    "shard_and_replica",
]
