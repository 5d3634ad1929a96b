"""Making sure every rank starts from the same model: copy rank 0's parameters and buffers to every rank.

The shapes are checked before this runs (:func:`shardkit.distributed.model_check.check_same_model`, called by
the wrapper's constructor), so a rank that built a different model fails on every rank with the same message and
no rank has been half-overwritten.
"""

from __future__ import annotations

from torch import nn

from shardkit.distributed.groups import GroupLike
from shardkit.nn.sharded_ddp.comm import broadcast_coalesced


def sync_module_states(module: nn.Module, group: GroupLike, chunk_bytes: int) -> None:
    """Copy rank 0's parameters and buffers to every rank of ``group``."""
    tensors = [p.detach() for p in module.parameters()] + [b.detach() for b in module.buffers()]
    broadcast_coalesced(tensors, 0, group, chunk_bytes, "sdp_sync_model")
