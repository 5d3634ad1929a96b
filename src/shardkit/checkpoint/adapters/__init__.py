"""One file per strategy: its universal source (saves and loads) and its legacy adapter (reads old layouts).

New checkpoints use the universal layout through each strategy's :class:`UniversalSource`
(:func:`shardkit.checkpoint.sources.source_for`). The adapters below, chosen by the types of the model
and optimizer (first match wins), read checkpoints written in the earlier layouts:

======================  =========================================  ==========  =====================
adapter                 model / optimizer                          layout      other world size
======================  =========================================  ==========  =====================
:class:`FSDPAdapter`    ``FullyShardedDataParallel``               fsdp-dcp    yes (DCP re-shards)
:class:`SMPAdapter`     ``smp.DistributedModel``                   full        yes
:class:`SlowMoAdapter`  ``SlowMoDistributedDataParallel``          per-rank    no (clear error)
:class:`OSSAdapter`     ``OSS`` (+ ``ShardedDataParallel``/DDP)    full        yes (OSS re-shards)
:class:`PlainAdapter`   any module, torch DDP; ``torch.optim``     full        yes
======================  =========================================  ==========  =====================
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from shardkit.checkpoint.adapters.base import Adapter, PendingLoad
from shardkit.checkpoint.adapters.fsdp import FSDPAdapter
from shardkit.checkpoint.adapters.oss import OSSAdapter
from shardkit.checkpoint.adapters.plain import PlainAdapter
from shardkit.checkpoint.adapters.registry import without_compile_wrapper
from shardkit.checkpoint.adapters.slowmo import SlowMoAdapter
from shardkit.checkpoint.adapters.smp import SMPAdapter

ADAPTERS = (FSDPAdapter, SMPAdapter, SlowMoAdapter, OSSAdapter, PlainAdapter)


def adapter_for(model: nn.Module, optimizer: Optional[Any]) -> Adapter:
    """The adapter that saves and loads ``model`` and ``optimizer`` (a ``torch.compile`` wrapper is looked through)."""
    model = without_compile_wrapper(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (the wrapped model you train), got {type(model).__name__}")
    for cls in ADAPTERS:
        if cls.handles(model, optimizer):
            return cls(model, optimizer)
    raise AssertionError("PlainAdapter handles every module")  # pragma: no cover


__all__ = [
    "ADAPTERS",
    "Adapter",
    "FSDPAdapter",
    "OSSAdapter",
    "PendingLoad",
    "PlainAdapter",
    "SMPAdapter",
    "SlowMoAdapter",
    "adapter_for",
]
