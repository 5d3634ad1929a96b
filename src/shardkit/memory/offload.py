"""Copying a tensor into host memory as one named operator, so tools that watch operators can tell offload apart.

Strategies that keep state in CPU memory (FSDP's ``cpu_offload``) copy it there through :func:`to_host` instead of
``tensor.to("cpu")``. On real tensors the two are the same copy. The difference is what a dispatch mode sees: a
``.to("cpu")`` is also how bookkeeping reads a small tensor back, while ``shardkit::to_host`` says "this tensor now
lives in host memory". ``shardkit.plan`` relies on that: planning on the meta device, it answers the operator with a
stand-in that reports the CPU and allocates nothing, and counts its bytes as host memory, apart from the device's.

Example::

    shard = to_host(local_chunk, pin=compute_device.type == "cuda")   # pinned so uploads overlap compute
    shard.grad = to_host(reduced_grad, dtype=shard.dtype)
"""

from __future__ import annotations

from typing import Optional

import torch


@torch.library.custom_op("shardkit::to_host", mutates_args=())
def _to_host_op(tensor: torch.Tensor, dtype: Optional[torch.dtype], pin: bool) -> torch.Tensor:
    out = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device="cpu", pin_memory=pin)
    out.copy_(tensor)
    return out


@_to_host_op.register_fake
def _to_host_fake(tensor: torch.Tensor, dtype: Optional[torch.dtype], pin: bool) -> torch.Tensor:
    if type(tensor) is torch.Tensor:  # a plain meta tensor (tracing passes its own tensor subclass)
        raise NotImplementedError(
            "shardkit cannot offload a meta tensor to CPU memory (it has no data to copy): materialise the model "
            "(e.g. model.to_empty(device=...) and reset_parameters()) before wrapping it with CPU offload"
        )
    return torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device="cpu")


#: The operator itself, for dispatch modes that answer it.
TO_HOST = torch.ops.shardkit.to_host.default


def to_host(tensor: torch.Tensor, dtype: Optional[torch.dtype] = None, pin: bool = False) -> torch.Tensor:
    """A new copy of ``tensor`` in CPU memory (in ``dtype``; page-locked when ``pin``), never a view of it.

    ``pin`` needs an accelerator (page-locked memory is what makes an upload asynchronous); the copy itself is
    synchronous, so the result is ready when this returns.
    """
    return _to_host_op(tensor.detach(), dtype, pin)


__all__ = ["TO_HOST", "to_host"]
