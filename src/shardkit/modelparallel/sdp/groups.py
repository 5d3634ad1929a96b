"""Which ranks shard a model together: the sharding groups inside each reduced-data-parallel group.

A reduced-data-parallel group (the ranks holding the same stage and tensor-parallel slice, in ``rdp_rank`` order) of
size ``R`` is cut into ``R / degree`` *sharding groups* of ``degree`` neighbouring ranks; the ranks at the same place
in each sharding group form a *replica group* (they hold the same shard, and all-reduce its gradient). Pure
arithmetic in :func:`sharding_ranks`; :func:`create_sdp_groups` creates the groups (collective over the world).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from shardkit.modelparallel.topology import Topology


def sharding_ranks(rdp_ranks: list[int], degree: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(sharding groups, replica groups)`` of one reduced-data-parallel group's global ranks.

    Example::

        sharding_ranks([0, 2, 4, 6], 2) == ([[0, 2], [4, 6]], [[0, 4], [2, 6]])
    """
    shards = [rdp_ranks[i : i + degree] for i in range(0, len(rdp_ranks), degree)]
    replicas = [[block[j] for block in shards] for j in range(degree)]
    return shards, replicas


def create_sdp_groups(topo: Topology, degree: int, owned: list[Any]) -> tuple[Any, Any]:
    """This rank's ``(sharding group, replica group)``; every group is created on every rank in the same order
    (``new_group`` is collective over the world) and appended to ``owned`` (destroyed by ``smp.reset``)."""
    mine: dict[str, Any] = {}
    seen: set[tuple[int, ...]] = set()
    for member in range(topo.world_size):
        rdp = tuple(topo.layout.group_ranks("data", member))
        if rdp in seen:
            continue
        seen.add(rdp)
        shards, replicas = sharding_ranks(list(rdp), degree)
        for kind, blocks in (("shard", shards), ("replica", replicas)):
            for ranks in blocks:
                group = dist.new_group(ranks)
                owned.append(group)
                if topo.rank in ranks:
                    mine[kind] = group
    return mine["shard"], mine["replica"]
