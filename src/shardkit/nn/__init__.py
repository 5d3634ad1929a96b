"""Data-parallel wrappers, wrapping helpers and activation checkpointing.

Names are imported on first use, so ``import shardkit.nn`` stays cheap and optional parts (for example the
Lightning integration) are never imported unless asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ShardedDataParallel": "shardkit.nn.sharded_ddp",
    "FullyShardedDataParallel": "shardkit.nn.fsdp",
    "CPUOffload": "shardkit.nn.fsdp",
    "BackwardPrefetch": "shardkit.nn.fsdp",
    "SlowMoDistributedDataParallel": "shardkit.nn.slowmo",
    "SlowMoBaseAlgorithm": "shardkit.nn.slowmo",
    "checkpoint_wrapper": "shardkit.nn.checkpoint",
    "enable_wrap": "shardkit.nn.wrap",
    "wrap": "shardkit.nn.wrap",
    "auto_wrap": "shardkit.nn.wrap",
    "default_auto_wrap_policy": "shardkit.nn.wrap",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit.nn' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
