"""torch FSDP's sharding strategies: what a unit shards, over which ranks, and when full parameters are freed.

The public constructor takes one of these as ``sharding_strategy=``; :mod:`shardkit.nn.fsdp.policies` turns it
into the sharding policy and :mod:`shardkit.nn.fsdp.hybrid` into the unit's two groups (the shard group the
parameters are split over, and the replica group gradient shards are all-reduced over).
"""

from __future__ import annotations

import enum


class ShardingStrategy(enum.Enum):
    """What a unit shards and where (torch FSDP's names and meanings).

    ``FULL_SHARD``: parameters, gradients and optimizer state sharded over the group; full parameters freed
    after forward and gathered again for backward (fairscale's ``reshard_after_forward=True``).
    ``SHARD_GRAD_OP``: the same, but full parameters are kept from forward to backward (one gather per step
    fewer, one unit's full parameters more in memory; ``reshard_after_forward=False``).
    ``NO_SHARD``: nothing sharded (DDP-like): every rank holds the full parameters, gradients are all-reduced.
    ``HYBRID_SHARD``: ``FULL_SHARD`` inside each node, replicated across nodes: after the node-local
    reduce-scatter each gradient shard is all-reduced with the ranks of the same local rank on the other nodes
    (parameter gathers never leave the node; per-rank parameter memory is ``1/processes per node``).
    ``_HYBRID_SHARD_ZERO2``: ``SHARD_GRAD_OP`` inside the node, with the same cross-node all-reduce.
    """

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()

    @property
    def is_hybrid(self) -> bool:
        """True for the strategies that shard inside a node and replicate across nodes."""
        return self.name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")  # torch's leading underscore kept

    @property
    def reshards_after_forward(self) -> bool:
        """Whether full parameters are freed after forward under this strategy."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
