"""Strategies combined in a way that cannot train: refused before training starts.

``DistributedDataParallel(FullyShardedDataParallel(model))`` looks like a way to add data parallelism, but FSDP
already averages gradients across ranks and each rank holds a different shard of every parameter: DDP broadcasts
rank 0's shards over the others at construction and then averages gradients of different shards, training a wrong
model without a word. Two points catch it, both before the first optimizer step:

- torch's DDP reads ``_ddp_params_and_buffers_to_ignore`` of the module it wraps at construction, before it
  broadcasts anything: FSDP answers that read with :func:`refuse_ddp_around` (an FSDP at the top of DDP's module);
- the first forward of an FSDP root runs :func:`refuse_inside_ddp`, which looks through the calling frames for
  DDP's forward (an FSDP deeper inside a plain module that DDP wraps; DDP has already broadcast by then, so the
  model must be rebuilt, which the error says).

OSS over FSDP's shards (OSS under FSDP, FSDP inside ShardedDataParallel) is refused by OSS itself
(:func:`shardkit.optim.zero1.arguments.refuse_fsdp_shards`).
"""

from __future__ import annotations

from types import FrameType
from typing import Optional

#: Why DDP around FSDP is refused.
DDP_AROUND_FSDP = (
    "DistributedDataParallel was given a model with FullyShardedDataParallel in it: FSDP already averages "
    "gradients across ranks, and each rank holds a different shard of every parameter, so DDP would broadcast rank "
    "0's shards over the other ranks' and average gradients of different shards, training a wrong model. Use FSDP "
    "alone (wrap the whole model; its ShardingStrategy.NO_SHARD or hybrid options replicate if that is what you "
    "want), or DDP alone, and rebuild the model."
)
#: The module of torch's DistributedDataParallel.
_DDP_MODULE = "torch.nn.parallel.distributed"


def _from_ddp(frame: Optional[FrameType]) -> bool:
    return frame is not None and frame.f_globals.get("__name__") == _DDP_MODULE


def refuse_ddp_around(reader: Optional[FrameType]) -> None:
    """Raise :data:`DDP_AROUND_FSDP` if the caller of ``reader`` (the frame answering FSDP's DDP-ignore list) is
    torch's DDP."""
    if _from_ddp(reader.f_back if reader is not None else None):
        raise ValueError(DDP_AROUND_FSDP)


def refuse_inside_ddp(frame: Optional[FrameType]) -> None:
    """Raise :data:`DDP_AROUND_FSDP` if any frame calling ``frame`` is torch's DDP (its forward, running this
    FSDP root's first forward). Walks the stack once per root: a few dozen frames."""
    while frame is not None:
        if _from_ddp(frame):
            raise ValueError(DDP_AROUND_FSDP)
        frame = frame.f_back
