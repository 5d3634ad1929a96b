"""Making sure every rank starts from the same model: copy rank 0's parameters and buffers to every rank.

The shapes are checked before this runs (:func:`shardkit.distributed.model_check.check_same_model`, called by
the wrapper's constructor), so a rank that built a different model fails on every rank with the same message and
no rank has been half-overwritten.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

from shardkit.distributed.groups import GroupLike
from shardkit.nn.sharded_ddp.comm import broadcast_coalesced


def sync_module_states(
    module: nn.Module, group: GroupLike, chunk_bytes: int, replica: Optional[GroupLike] = None
) -> None:
    """Copy rank 0's parameters and buffers to every rank of ``group`` (and of its nodes, see
    :func:`broadcast_across_nodes`)."""
    tensors = [p.detach() for p in module.parameters()] + [b.detach() for b in module.buffers()]
    broadcast_across_nodes(tensors, group, replica, chunk_bytes, "sdp_sync_model")


def broadcast_across_nodes(
    tensors: Sequence[torch.Tensor], group: GroupLike, replica: Optional[GroupLike], chunk_bytes: int, label: str
) -> None:
    """Give every rank the values of member 0 of member 0's node: first each replica group copies its first
    node's values (every local rank in parallel, one shard-sized hop per rank over the slow link), then each node
    copies its local rank 0's, which now hold node 0's local rank 0 values."""
    if replica is not None:
        broadcast_coalesced(tensors, 0, replica, chunk_bytes, f"{label}:inter")
    broadcast_coalesced(tensors, 0, group, chunk_bytes, label)
