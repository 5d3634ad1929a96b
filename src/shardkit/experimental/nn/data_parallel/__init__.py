"""Compatibility path: fairscale kept SlowMo under ``experimental``; shardkit's lives in ``shardkit.nn.slowmo``."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SlowMoDistributedDataParallel": "shardkit.nn.slowmo",
    "SlowMoBaseAlgorithm": "shardkit.nn.slowmo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit.experimental.nn.data_parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
