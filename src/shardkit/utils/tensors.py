"""Helpers for nested containers of tensors (state dicts, optimizer state)."""

from __future__ import annotations

from typing import Any

import torch


def to_cpu(value: Any) -> Any:
    """A copy of a nested value (dicts, lists, tuples) with every tensor detached and copied to the CPU.

    Always a copy, never an alias of live state: what is pickled to another rank or written to a file must not
    change when training goes on, and pickled CUDA tensors would keep their device. Container types (for
    example ``OrderedDict``) are kept.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, to_cpu(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value
