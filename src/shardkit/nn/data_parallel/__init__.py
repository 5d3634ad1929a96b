"""Compatibility path for fairscale users: ``from shardkit.nn.data_parallel import ...``."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ShardedDataParallel": "shardkit.nn.sharded_ddp",
    "FullyShardedDataParallel": "shardkit.nn.fsdp",
    "TrainingState": "shardkit.nn.fsdp",
    "SlowMoDistributedDataParallel": "shardkit.nn.slowmo",
    "SlowMoBaseAlgorithm": "shardkit.nn.slowmo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit.nn.data_parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
