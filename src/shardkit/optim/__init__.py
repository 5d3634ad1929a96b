"""Optimizer-state sharding (ZeRO-1) and AMP loss scaling for sharded gradients."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "OSS": "shardkit.optim.oss",
    "ShardedGradScaler": "shardkit.optim.grad_scaler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
