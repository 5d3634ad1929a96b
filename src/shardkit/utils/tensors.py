"""Helpers for tensors: copying nested containers (state dicts, optimizer state), cutting lists into buckets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: Attribute FullyShardedDataParallel sets on every flat shard it creates (read by :mod:`shardkit.compat.fairscale`,
#: and by OSS, which refuses to partition shards again). Here, below both, so neither imports the other.
FLAT_SHARD_MARK = "is_fsdp_flat_shard"


def is_fsdp_shard(tensor: Any) -> bool:
    """Whether ``tensor`` is a flat shard of FullyShardedDataParallel (a parameter it created)."""
    return bool(getattr(tensor, FLAT_SHARD_MARK, False))


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


def runs_by_kind(tensors: Sequence[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by device and dtype (in order of first appearance), each group cut into runs of at most
    ``max_bytes``; a tensor larger than that makes a run of its own. What flat communication buckets hold."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    runs: list[list[torch.Tensor]] = []
    for group in by_kind.values():
        current: list[torch.Tensor] = []
        current_bytes = 0
        for t in group:
            size = t.numel() * t.element_size()
            if current and current_bytes + size > max_bytes:
                runs.append(current)
                current, current_bytes = [], 0
            current.append(t)
            current_bytes += size
        if current:
            runs.append(current)
    return runs
