"""Collectives of ShardedDataParallel that the shared module does not offer: coalesced broadcasts of many small
tensors (parameters at startup, buffers at every forward).

Tensor traffic still goes through :mod:`shardkit.distributed.collectives`, so it is labelled, metered and
delayed like every other shardkit collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardkit.distributed import collectives
from shardkit.distributed.groups import GroupLike, group_rank, group_size
from shardkit.utils.tensors import runs_by_kind


@torch.no_grad()
def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], src_in_group: int, group: GroupLike, chunk_bytes: int, label: str
) -> None:
    """Overwrite ``tensors`` on every rank with member ``src_in_group``'s values.

    Small tensors of one device and dtype travel together in flat chunks of at most ``chunk_bytes`` (one
    collective per chunk instead of one per tensor); a lone contiguous tensor is broadcast in place. All chunks
    are issued asynchronously before any is waited on.
    """
    if group_size(group) == 1 or not tensors:
        return
    receiving = group_rank(group) != src_in_group
    pending: list[tuple[collectives.Handle, list[torch.Tensor], torch.Tensor]] = []
    for chunk in runs_by_kind(tensors, max(chunk_bytes, 1)):
        if len(chunk) == 1 and chunk[0].is_contiguous():
            flat = chunk[0]
        elif receiving:
            flat = torch.empty(sum(t.numel() for t in chunk), dtype=chunk[0].dtype, device=chunk[0].device)
        else:
            flat = torch.cat([t.reshape(-1) for t in chunk])
        handle = collectives.broadcast(flat, src_in_group, group=group, async_op=True, label=label)
        pending.append((handle, chunk, flat))
    for handle, chunk, flat in pending:
        handle.wait()
        if not receiving or flat is chunk[0]:
            continue
        offset = 0
        for t in chunk:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
