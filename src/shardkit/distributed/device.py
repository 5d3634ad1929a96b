"""Which accelerator a process computes on: ``cuda:LOCAL_RANK`` on a multi-GPU node, chosen once.

torchrun starts one process per GPU and tells each its ``LOCAL_RANK``; nothing in torch then selects that GPU, so
a process that never calls ``torch.cuda.set_device`` allocates on, and runs NCCL from, ``cuda:0``: eight ranks on
one GPU. :func:`select_device` is the one documented call that fixes it (call it first thing, or let any shardkit
strategy call it for you when it is built). Its rule:

- no CUDA, or a process that already chose a device other than ``cuda:0``: nothing changes;
- ``LOCAL_RANK`` set and naming a visible GPU: that GPU becomes the current device;
- ``LOCAL_RANK`` beyond the visible GPUs but one GPU visible (a launcher that sets ``CUDA_VISIBLE_DEVICES`` per
  rank): ``cuda:0``, the only one there is;
- otherwise a clear error, since guessing would put two ranks on one GPU.

Example::

    from shardkit.distributed.device import select_device
    device = select_device()            # cuda:LOCAL_RANK, or cpu on a machine without CUDA
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
"""

from __future__ import annotations

import os
from typing import Optional

import torch


def _local_rank() -> Optional[int]:
    raw = os.environ.get("LOCAL_RANK")
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer, got {raw!r}; it is set by torchrun") from None


def cuda_index_for_rank(local_rank: Optional[int], visible: int, current: int) -> int:
    """The CUDA device index a process with ``local_rank`` should use, given ``visible`` GPUs and its ``current``.

    A pure function (no CUDA calls), so the rule is testable on any machine."""
    if current != 0 or local_rank is None:
        return current  # the process chose already (or nobody told us which rank this is): keep its choice
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise RuntimeError(
        f"LOCAL_RANK is {local_rank} but only {visible} GPUs are visible to this process; launch at most {visible} "
        "processes per node, or give each its own GPU with CUDA_VISIBLE_DEVICES"
    )


def select_device() -> torch.device:
    """This process's compute device: ``cuda:LOCAL_RANK`` made current when CUDA is there, else ``cpu``.

    Idempotent and cheap; every shardkit strategy calls it when it first needs a CUDA device."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    current = torch.cuda.current_device()
    index = cuda_index_for_rank(_local_rank(), torch.cuda.device_count(), current)
    if index != current:
        torch.cuda.set_device(index)
    return torch.device("cuda", index)


def current_cuda_device() -> torch.device:
    """The CUDA device this rank computes on (selected by :func:`select_device` first). CUDA must be available."""
    device = select_device()
    if device.type != "cuda":
        raise RuntimeError("current_cuda_device() needs CUDA, but torch.cuda.is_available() is False")
    return device


__all__ = ["cuda_index_for_rank", "current_cuda_device", "select_device"]
