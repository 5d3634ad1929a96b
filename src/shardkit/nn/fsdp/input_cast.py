"""Casting a unit's forward inputs: to the compute dtype under mixed precision, or float16 to float32 with
``force_input_to_fp32``, after moving them to the compute device under CPU offload. Each caster is a function
over a nested structure (tuples, lists, dicts of tensors) that changes the tensors and leaves everything else as
it is. Example::

    cast = unit_input_caster(torch.bfloat16, False, None)
    args, kwargs = cast((args, kwargs))
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from shardkit.utils._torch_private import tree_map


def unit_input_caster(
    param_dtype: Optional[torch.dtype], force_input_to_fp32: bool, offload_device: Optional[torch.device]
) -> Callable[[Any], Any]:
    """What a unit applies to its forward inputs: the compute dtype ``param_dtype`` under mixed precision (every
    mixed-precision unit casts, a no-op below a mixed-precision root, so one inside a full-precision root still
    gets its compute dtype), else float16 to float32 (differentiably) with ``force_input_to_fp32``.

    Under CPU offload (``offload_device``: the compute device offload chose, the rank's GPU when there is one)
    each tensor is first brought there: the unit computes on an accelerator the caller never named (the model and
    its batch stay in host memory), as torch's FSDP does for its root. Meta tensors stay where they are: they are
    a plan's stand-ins (``shardkit plan``), and copying one to a real device would invent its data."""
    if param_dtype is None and not force_input_to_fp32 and offload_device is None:
        return _unchanged

    def cast(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if offload_device is not None and tensor.device != offload_device and not tensor.is_meta:
            tensor = tensor.to(offload_device)
        if param_dtype is not None and tensor.is_floating_point() and tensor.dtype != param_dtype:
            return tensor.to(param_dtype)
        if param_dtype is None and force_input_to_fp32 and tensor.dtype == torch.float16:
            return tensor.float()
        return tensor

    return lambda tree: tree_map(cast, tree)


def make_input_mover(device: torch.device) -> Callable[[Any], Any]:
    """Move every tensor of a nested structure that is elsewhere to ``device`` (meta tensors stay; see
    :func:`unit_input_caster`)."""
    return unit_input_caster(None, False, device)


def _unchanged(tree: Any) -> Any:
    return tree
