"""Collectives of picklable Python objects: the one home for every bookkeeping-sized exchange.

Tensor traffic goes through :mod:`shardkit.distributed.collectives`. These helpers move small pickled objects
(signatures, metadata, consolidated state on its way to one rank) and are labelled like every other collective
(``shardkit::<op>:<label>`` in a profile). Each accepts any :data:`GroupLike`: on a ``DummyProcessGroup`` or a
group of one rank nothing is communicated. Ranks are given *inside the group*; the global ranks torch wants are
looked up here.

Example::

    signatures = all_gather_objects(my_signature, group, "FSDP.param_check")   # one entry per group rank
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from shardkit.distributed.device import select_device
from shardkit.distributed.groups import GroupLike, global_rank, group_rank, group_size, is_dummy, resolve_group
from shardkit.distributed.instrumentation import blocking_call


def _on_rank_device(group: dist.ProcessGroup) -> None:
    """NCCL's object collectives stage the pickled bytes on ``torch.cuda.current_device()``; on a node whose
    processes never selected their GPU that is ``cuda:0`` on every rank, which NCCL refuses or hangs on."""
    if dist.get_backend(group) == "nccl":
        select_device()


def all_gather_objects(obj: Any, group: Optional[GroupLike], label: str) -> list[Any]:
    """Every member's ``obj``, in group-rank order, on every member."""
    group = resolve_group(group)
    size = group_size(group)
    if is_dummy(group) or size == 1:
        return [obj]
    assert isinstance(group, dist.ProcessGroup)
    _on_rank_device(group)
    gathered: list[Any] = [None] * size
    with blocking_call(f"shardkit::all_gather_object:{label}", group):
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def gather_objects(obj: Any, dst_in_group: int, group: Optional[GroupLike], label: str) -> Optional[list[Any]]:
    """Every member's ``obj``, in group-rank order, on member ``dst_in_group`` only (None elsewhere)."""
    group = resolve_group(group)
    size = group_size(group)
    if is_dummy(group) or size == 1:
        return [obj]
    assert isinstance(group, dist.ProcessGroup)
    _on_rank_device(group)
    receiving = group_rank(group) == dst_in_group
    gathered: Optional[list[Any]] = [None] * size if receiving else None
    with blocking_call(f"shardkit::gather_object:{label}", group):
        dist.gather_object(obj, gathered, dst=global_rank(group, dst_in_group), group=group)
    return gathered


def broadcast_object(obj: Any, src_in_group: int = 0, group: Optional[GroupLike] = None, label: str = "") -> Any:
    """Member ``src_in_group``'s ``obj`` on every member (what other members pass is ignored)."""
    group = resolve_group(group)
    if is_dummy(group) or group_size(group) == 1:
        return obj
    assert isinstance(group, dist.ProcessGroup)
    _on_rank_device(group)
    holder = [obj]
    with blocking_call(f"shardkit::broadcast_object:{label or 'object'}", group):
        dist.broadcast_object_list(holder, src=global_rank(group, src_in_group), group=group)
    return holder[0]


__all__ = ["all_gather_objects", "broadcast_object", "gather_objects"]
