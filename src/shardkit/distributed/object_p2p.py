"""Point-to-point Python objects: one rank sends a picklable object, one named rank receives it.

Kept apart from :mod:`shardkit.distributed.objects` (the object collectives) because it travels through the
labelled tensor sends of :mod:`shardkit.distributed.collectives`, which the health checks below ``objects`` use.
Two messages per object (its pickled size, then its bytes) with a tag of their own, so a pending object receive
never matches other traffic between the same two ranks. Under NCCL the bytes travel through the current CUDA
device.

Example::

    if rank == 0:
        send_object({"epoch": 3}, dst=1, group=world)
    else:
        meta = recv_object(src=0, group=world)
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardkit.distributed import collectives as C
from shardkit.distributed.device import current_cuda_device
from shardkit.distributed.groups import GroupLike, resolve_group

#: Tag of object messages.
_OBJECT_TAG = 0x0B1


def _wire_device(group: dist.ProcessGroup, device: Optional[torch.device]) -> torch.device:
    """Where an object's bytes travel: ``device`` if given, else this rank's GPU under NCCL (which cannot send host
    memory; selected from ``LOCAL_RANK`` first, as every shardkit NCCL path does, or every rank would use cuda:0),
    else the CPU."""
    if device is not None:
        return device
    if dist.get_backend(group) == "nccl":
        return current_cuda_device()
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


__all__ = ["recv_object", "send_object"]
