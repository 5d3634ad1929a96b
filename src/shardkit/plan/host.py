"""Host memory in a planned run: a tensor that says it is on the CPU and allocates nothing.

A planned rank runs on the meta device, so the state a strategy offloads to CPU memory (FSDP's ``cpu_offload``:
parameter shards, their gradients, and the optimizer state the CPU step creates) must neither be allocated on this
machine nor be counted as device memory. The strategy copies it out through the ``shardkit::to_host`` operator
(:mod:`shardkit.memory.offload`); the planner's dispatch mode answers that operator with a :class:`HostTensor`: a
tensor subclass whose ``device`` is ``cpu`` (so the strategy's own "is this offloaded?" tests and torch's device
checks take the offload path the real run takes) around a meta tensor of the same shape (so nothing is allocated).
Every operator on it runs on the meta tensor inside; its results stay host tensors, except a copy to another device
(an upload before the all-gather), which is an ordinary meta tensor: device memory again. The accountant counts a
host tensor's storage in a book of its own, and the bytes crossing between the two memories per phase.

Example::

    shard = HostTensor(torch.empty(1024, device="meta"))
    assert shard.device.type == "cpu"
    upload = shard.to("meta", torch.bfloat16)      # a plain meta tensor: device memory
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from shardkit.utils._torch_private import tree_flatten, tree_map
from shardkit.utils.wrapper_tensor import NO_TORCH_FUNCTION, new_wrapper

aten = torch.ops.aten


class HostTensor(torch.Tensor):
    """A planned tensor in host memory: reports ``device='cpu'``, holds a meta tensor (``meta_tensor``)."""

    meta_tensor: torch.Tensor

    @staticmethod
    def __new__(cls, meta_tensor: torch.Tensor) -> HostTensor:
        if meta_tensor.device.type != "meta":
            raise ValueError(f"HostTensor stands in for host memory in a meta run; got a {meta_tensor.device} tensor")
        out = new_wrapper(
            cls,
            meta_tensor.shape,
            meta_tensor.dtype,
            torch.device("cpu"),
            meta_tensor.requires_grad,
            meta_tensor.stride(),
            int(meta_tensor.storage_offset()),
        )
        out.meta_tensor = meta_tensor
        return out

    # Every operator goes to __torch_dispatch__, below autograd.
    __torch_function__ = NO_TORCH_FUNCTION

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # the default reads data
        return f"HostTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is aten.is_pinned.default:
            # Answered "not pinned", so the strategy copies gradients down with shardkit::to_host (counted as host
            # memory) rather than into page-locked buffers of its own: the same bytes either way.
            return False
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        target = kwargs.get("device")
        if target is not None and torch.device(target).type != "cpu":
            return out  # a copy to the device: device memory
        held = {id(t.meta_tensor): t for t in tree_flatten((args, kwargs))[0] if isinstance(t, HostTensor)}
        return tree_map(lambda t: _rewrap(t, held), out)


def _rewrap(value: Any, held: dict[int, HostTensor]) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    same = held.get(id(value))  # an in-place result is the same host tensor
    return same if same is not None else HostTensor(value)


def unwrap(value: Any) -> Any:
    """The meta tensor inside a :class:`HostTensor`; anything else as it is."""
    return value.meta_tensor if isinstance(value, HostTensor) else value


def host_copy(tensor: torch.Tensor, dtype: Any = None) -> HostTensor:
    """What ``shardkit::to_host`` makes of a meta ``tensor`` in a planned run: a host tensor, nothing allocated."""
    return HostTensor(torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device="meta"))


__all__ = ["HostTensor", "host_copy", "unwrap"]
