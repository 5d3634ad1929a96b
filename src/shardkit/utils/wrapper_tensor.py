"""Tensor subclasses that hold no data of their own (torch's "wrapper subclasses"), made in one place.

A wrapper subclass answers shape, dtype and device from its own metadata and sends every operator to its
``__torch_dispatch__``; shardkit has two: FSDP's shape-only placeholders between steps, and the planner's host-memory
stand-ins. Both reach the same two torch hooks, kept here.

Example::

    class Stub(torch.Tensor):
        __torch_function__ = NO_TORCH_FUNCTION      # every operator goes to __torch_dispatch__

        @staticmethod
        def __new__(cls, shape):
            return new_wrapper(cls, shape, torch.float32, torch.device("cpu"), requires_grad=False)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, TypeVar, cast

import torch

from shardkit.utils._torch_private import disabled_torch_function_impl, make_wrapper_subclass

T = TypeVar("T", bound=torch.Tensor)

#: ``__torch_function__`` for a wrapper subclass: no Python-level override, operators reach ``__torch_dispatch__``.
NO_TORCH_FUNCTION: Any = disabled_torch_function_impl  # Any: it replaces a classmethod


def new_wrapper(
    cls: type[T],
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    requires_grad: bool,
    strides: Optional[Sequence[int]] = None,
    storage_offset: Optional[int] = None,
) -> T:
    """A tensor of class ``cls`` with this metadata and no storage of its own (``__new__`` of a wrapper subclass)."""
    return cast(
        T,
        make_wrapper_subclass(
            cls,
            shape,
            strides=strides,
            storage_offset=storage_offset,
            dtype=dtype,
            device=device,
            requires_grad=requires_grad,
        ),
    )


__all__ = ["NO_TORCH_FUNCTION", "new_wrapper"]
