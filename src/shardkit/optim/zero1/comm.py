"""Object collectives for the rare, bookkeeping-sized exchanges of OSS (state migration, consolidation).

Tensor traffic goes through :mod:`shardkit.distributed.collectives`; these helpers move pickled Python objects
and are labelled the same way so they show up in a profile.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch.profiler import record_function

from shardkit.distributed.groups import GroupLike, global_rank, group_rank, group_size
from shardkit.distributed.objects import broadcast_object


def broadcast_obj(obj: Any, src_in_group: int, group: GroupLike, label: str) -> Any:
    """Broadcast a picklable object from member ``src_in_group``; returns it on every rank."""
    with record_function(f"shardkit::broadcast_object:{label}"):
        return broadcast_object(obj, src_in_group, group)


def gather_obj(obj: Any, dst_in_group: int, group: GroupLike, label: str) -> Optional[list[Any]]:
    """Gather one object per rank, in rank order, onto member ``dst_in_group`` (all members when it is -1).

    Returns the list on the receiving rank(s) and None elsewhere.
    """
    size = group_size(group)
    if size == 1:
        return [obj]
    assert isinstance(group, dist.ProcessGroup)
    with record_function(f"shardkit::gather_object:{label}"):
        if dst_in_group == -1:
            everything: list[Any] = [None] * size
            dist.all_gather_object(everything, obj, group=group)
            return everything
        receiving = group_rank(group) == dst_in_group
        gathered: Optional[list[Any]] = [None] * size if receiving else None
        dist.gather_object(obj, gathered, dst=global_rank(group, dst_in_group), group=group)
        return gathered
