"""Compatibility path: the textbook volumes of torch's own collectives moved to
:mod:`shardkit.distributed.comm_formulas`; this module re-exports them."""

from shardkit.distributed.comm_formulas import (
    ddp_allreduce_bytes,
    ddp_buffer_broadcast_bytes,
    ddp_plus_param_broadcast_bytes,
    fsdp_full_shard_bytes,
    param_bytes,
    trainable_bytes,
)

__all__ = [
    "ddp_allreduce_bytes",
    "ddp_buffer_broadcast_bytes",
    "ddp_plus_param_broadcast_bytes",
    "fsdp_full_shard_bytes",
    "param_bytes",
    "trainable_bytes",
]
