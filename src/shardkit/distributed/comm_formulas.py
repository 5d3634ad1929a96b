"""Bytes per step of the collectives torch issues internally, which shardkit's comm meter cannot see.

shardkit's own collectives are counted exactly by :func:`shardkit.distributed.count_comm_bytes`. torch DDP's
gradient all-reduce (in its C++ reducer), ZeroRedundancyOptimizer's parameter broadcasts and torch FSDP's
all-gathers bypass them, so for those the benchmark adds the textbook volume computed here, with the same
conventions as :class:`~shardkit.distributed.CommMeter`'s ``wire_bytes`` (bytes one rank sends, ring
algorithms): all-reduce ``2(n-1)/n`` of the buffer, all-gather, reduce-scatter and broadcast ``(n-1)/n`` of
the full buffer.

Every function takes the *unwrapped* model (before a strategy changed it) and the world size.
"""

from __future__ import annotations

from torch import nn


def trainable_bytes(module: nn.Module) -> int:
    """Bytes of the parameters that receive gradients (tied weights counted once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def param_bytes(module: nn.Module) -> int:
    """Bytes of all parameters (tied weights counted once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def ddp_allreduce_bytes(model: nn.Module, world_size: int) -> int:
    """torch DDP: every gradient bucket is all-reduced once per step."""
    n = world_size
    return int(2 * (n - 1) / n * trainable_bytes(model))


def ddp_buffer_broadcast_bytes(model: nn.Module, world_size: int) -> int:
    """torch DDP (``broadcast_buffers=True``, its default): rank 0's buffers are broadcast before every forward."""
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return int((world_size - 1) / world_size * buffer_bytes)


def ddp_plus_param_broadcast_bytes(model: nn.Module, world_size: int) -> int:
    """torch DDP + ZeroRedundancyOptimizer: the all-reduce, then each rank's updated shard broadcast to all."""
    broadcast = int((world_size - 1) / world_size * param_bytes(model))
    return ddp_allreduce_bytes(model, world_size) + broadcast


def fsdp_full_shard_bytes(model: nn.Module, world_size: int) -> int:
    """torch FSDP (1 and 2) wrapping each block and the root, resharding after forward.

    Forward all-gathers every parameter; backward all-gathers the blocks' parameters again (the root's stay
    unsharded between forward and backward, as torch does for the root); gradients are reduce-scattered.
    """
    n = world_size
    blocks = getattr(model, "blocks", None)
    block_bytes = param_bytes(blocks) if isinstance(blocks, nn.Module) else 0
    gathered = param_bytes(model) + block_bytes
    return int((n - 1) / n * (gathered + trainable_bytes(model)))
