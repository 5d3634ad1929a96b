"""``shardkit.nn.FullyShardedDataParallel`` (ZeRO-3) checkpoints.

The legacy ``fsdp-dcp`` layout is read and written by :class:`FSDPAdapter` (see :mod:`.fsdp_legacy`).
"""

from __future__ import annotations

from shardkit.checkpoint.adapters.fsdp_legacy import FSDPAdapter

__all__ = ["FSDPAdapter"]
