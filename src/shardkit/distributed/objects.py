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

import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardkit.distributed import collectives as C
from shardkit.distributed.groups import GroupLike, global_rank, group_rank, group_size, is_dummy, resolve_group

#: Tag of object messages, so a pending object receive never matches other traffic between the same two ranks.
_OBJECT_TAG = 0x0B1


def all_gather_objects(obj: Any, group: Optional[GroupLike], label: str) -> list[Any]:
    """Every member's ``obj``, in group-rank order, on every member."""
    group = resolve_group(group)
    size = group_size(group)
    if is_dummy(group) or size == 1:
        return [obj]
    assert isinstance(group, dist.ProcessGroup)
    gathered: list[Any] = [None] * size
    with record_function(f"shardkit::all_gather_object:{label}"):
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def gather_objects(obj: Any, dst_in_group: int, group: Optional[GroupLike], label: str) -> Optional[list[Any]]:
    """Every member's ``obj``, in group-rank order, on member ``dst_in_group`` only (None elsewhere)."""
    group = resolve_group(group)
    size = group_size(group)
    if is_dummy(group) or size == 1:
        return [obj]
    assert isinstance(group, dist.ProcessGroup)
    receiving = group_rank(group) == dst_in_group
    gathered: Optional[list[Any]] = [None] * size if receiving else None
    with record_function(f"shardkit::gather_object:{label}"):
        dist.gather_object(obj, gathered, dst=global_rank(group, dst_in_group), group=group)
    return gathered


def broadcast_object(obj: Any, src_in_group: int = 0, group: Optional[GroupLike] = None, label: str = "") -> Any:
    """Member ``src_in_group``'s ``obj`` on every member (what other members pass is ignored)."""
    group = resolve_group(group)
    if is_dummy(group) or group_size(group) == 1:
        return obj
    assert isinstance(group, dist.ProcessGroup)
    holder = [obj]
    with record_function(f"shardkit::broadcast_object:{label or 'object'}"):
        dist.broadcast_object_list(holder, src=global_rank(group, src_in_group), group=group)
    return holder[0]


def _wire_device(group: dist.ProcessGroup, device: Optional[torch.device]) -> torch.device:
    """Where an object's bytes travel: ``device`` if given, else the current CUDA device under NCCL (which cannot
    send host memory), else the CPU."""
    if device is not None:
        return device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_object(
    obj: Any, dst: int, group: Optional[GroupLike] = None, label: str = "", device: Optional[torch.device] = None
) -> None:
    """Send a picklable ``obj`` to global rank ``dst`` (a :func:`recv_object` there receives it); blocks until
    the bytes are handed to the transport. Two messages: the pickled size, then the bytes."""
    peers = resolve_group(group)
    assert isinstance(peers, dist.ProcessGroup), "objects travel only on a real process group"
    wire = _wire_device(peers, device)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(wire)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=wire)
    with record_function(f"shardkit::send_object:{label or 'object'}"):
        C.send(size, dst, peers, label=f"{label}:size", tag=_OBJECT_TAG).wait()
        C.send(payload, dst, peers, label=label, tag=_OBJECT_TAG).wait()


def recv_object(
    src: int, group: Optional[GroupLike] = None, label: str = "", device: Optional[torch.device] = None
) -> Any:
    """Receive the object global rank ``src`` sent with :func:`send_object` (blocks until it arrives)."""
    peers = resolve_group(group)
    assert isinstance(peers, dist.ProcessGroup), "objects travel only on a real process group"
    wire = _wire_device(peers, device)
    size = torch.zeros(1, dtype=torch.int64, device=wire)
    with record_function(f"shardkit::recv_object:{label or 'object'}"):
        C.recv(size, src, peers, label=f"{label}:size", tag=_OBJECT_TAG).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=wire)
        C.recv(payload, src, peers, label=label, tag=_OBJECT_TAG).wait()
    return pickle.loads(payload.cpu().numpy().tobytes())


__all__ = ["all_gather_objects", "broadcast_object", "gather_objects", "recv_object", "send_object"]
