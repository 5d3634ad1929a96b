"""Casting a unit's forward inputs: to the compute dtype under mixed precision, or float16 to float32 with
``force_input_to_fp32``. Each returns a function over a nested structure (tuples, lists, dicts of tensors) that
casts the floating-point tensors and leaves everything else as it is. Example::

    cast = make_input_caster(torch.bfloat16)
    args, kwargs = cast((args, kwargs))
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from shardkit.utils._torch_private import tree_map


def make_input_caster(dtype: torch.dtype) -> Callable[[Any], Any]:
    """A function casting every floating-point tensor in a nested structure to ``dtype``."""

    def cast(tensor: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dtype != dtype:
            return tensor.to(dtype)
        return tensor

    return lambda tree: tree_map(cast, tree)


def make_fp16_to_fp32_caster() -> Callable[[Any], Any]:
    """``force_input_to_fp32``: cast float16 tensors in a nested structure to float32 (differentiably)."""

    def cast(tensor: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float16:
            return tensor.float()
        return tensor

    return lambda tree: tree_map(cast, tree)


def make_input_mover(device: torch.device) -> Callable[[Any], Any]:
    """Move every tensor of a nested structure that is elsewhere to ``device``.

    Under CPU offload the unit computes on an accelerator the caller never named (the model and its batch stay in
    host memory), so the unit brings the batch along, as torch's FSDP does for its root. Meta tensors stay: they
    are a plan's stand-ins (``shardkit plan``), and copying one to a real device would invent its data."""

    def move(tensor: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and tensor.device != device and not tensor.is_meta:
            return tensor.to(device)
        return tensor

    return lambda tree: tree_map(move, tree)


def unit_input_caster(
    param_dtype: Optional[torch.dtype], force_input_to_fp32: bool, offload_device: Optional[torch.device]
) -> Callable[[Any], Any]:
    """What a unit applies to its forward inputs: the compute dtype ``param_dtype`` under mixed precision (every
    mixed-precision unit casts, a no-op below a mixed-precision root, so one inside a full-precision root still
    gets its compute dtype), else float16 to float32 with ``force_input_to_fp32``; under CPU offload
    (``offload_device``: the compute device offload chose, the rank's GPU when there is one) the batch is first
    brought there."""
    if param_dtype is not None:
        cast = make_input_caster(param_dtype)
    elif force_input_to_fp32:
        cast = make_fp16_to_fp32_caster()
    else:
        cast = _unchanged
    if offload_device is None:
        return cast
    move = make_input_mover(offload_device)
    return lambda tree: cast(move(tree))


def _unchanged(tree: Any) -> Any:
    return tree
