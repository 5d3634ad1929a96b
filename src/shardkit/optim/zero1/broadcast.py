"""Sending updated parameters from their owners to every rank, in flat buckets.

Each owner's trainable parameters are grouped by device and dtype and packed into flat buffers of at most
``bucket_bytes`` (a tensor larger than that travels alone, in place when it needs no conversion). All buckets are
broadcast asynchronously and only then waited on, so transfers from different owners overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardkit.distributed import collectives
from shardkit.distributed.groups import GroupLike
from shardkit.optim.zero1.partition import Partition

#: Upper bound on one flat broadcast buffer; bigger buckets mean fewer collectives but more transient memory.
DEFAULT_BUCKET_BYTES = 2**24

_COMPRESSIBLE = (torch.float32, torch.float64)


@dataclass(frozen=True)
class BroadcastBucket:
    """Parameters sent together by ``owner``: same device and dtype, sent as ``wire_dtype``."""

    owner: int
    params: tuple[torch.Tensor, ...]
    wire_dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def in_place(self) -> bool:
        """A lone contiguous tensor sent in its own dtype needs no flat buffer: it is broadcast directly."""
        only = self.params[0]
        return len(self.params) == 1 and only.dtype == self.wire_dtype and only.is_contiguous()


def plan_buckets(
    partition: Partition, broadcast_fp16: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[BroadcastBucket]:
    """The broadcast buckets of ``partition``, in the same order on every rank.

    With ``broadcast_fp16`` fp32/fp64 parameters travel as fp16, halving the bytes on the wire.
    """
    buckets: list[BroadcastBucket] = []
    for owner in range(partition.world_size):
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in partition.owned(owner, trainable_only=True):
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        for (_, dtype), params in by_kind.items():
            wire = torch.float16 if broadcast_fp16 and dtype in _COMPRESSIBLE else dtype
            itemsize = torch.empty((), dtype=wire).element_size()
            current: list[torch.Tensor] = []
            current_bytes = 0
            for p in params:
                size = p.numel() * itemsize
                if current and current_bytes + size > bucket_bytes:
                    buckets.append(BroadcastBucket(owner, tuple(current), wire))
                    current, current_bytes = [], 0
                current.append(p)
                current_bytes += size
            if current:
                buckets.append(BroadcastBucket(owner, tuple(current), wire))
    return buckets


@torch.no_grad()
def broadcast_params(buckets: Sequence[BroadcastBucket], rank: int, group: GroupLike) -> None:
    """Overwrite every rank's copy of each bucket's parameters with the owner's values.

    The owner keeps its own full-precision values; with fp16 buckets the other ranks receive them rounded.
    """
    pending = []
    for bucket in buckets:
        if bucket.in_place:
            flat = bucket.params[0].data
        elif bucket.owner == rank:
            flat = torch.cat([p.detach().reshape(-1).to(bucket.wire_dtype) for p in bucket.params])
        else:
            flat = torch.empty(bucket.numel, dtype=bucket.wire_dtype, device=bucket.params[0].device)
        handle = collectives.broadcast(flat, bucket.owner, group, async_op=True, label=f"oss.params.from{bucket.owner}")
        pending.append((bucket, flat, handle))
    for bucket, flat, handle in pending:
        handle.wait()
        if bucket.in_place or bucket.owner == rank:
            continue
        offset = 0
        for p in bucket.params:
            p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
