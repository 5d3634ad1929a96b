"""Default sizes of the flat buffers that pack many small tensors into one collective.

One home for the numbers, so every strategy that buckets agrees and a change is made once. They follow
fairscale's defaults (OSS broadcasts parameters in 16 MiB buckets, ShardedDataParallel reduces gradients in
8 MiB buckets): large enough that per-collective latency stops mattering, small enough that the extra buffer
stays a modest share of memory.
"""

from __future__ import annotations

BROADCAST_BUCKET_BYTES = 2**24
"""Largest flat buffer used to broadcast parameters (ZeRO-1's exchange after a step)."""

REDUCE_BUCKET_BYTES = 2**23
"""Largest flat buffer used to reduce gradients to their owner (ZeRO-2), or to broadcast small tensors together."""

__all__ = ["BROADCAST_BUCKET_BYTES", "REDUCE_BUCKET_BYTES"]
