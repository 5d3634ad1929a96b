"""Making sure every rank starts from the same model: check the shapes first, then copy rank 0's values.

The check runs before anything is broadcast, so a rank that built a different model fails on every rank with
the same message and no rank has been half-overwritten.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from shardkit.distributed.groups import GroupLike
from shardkit.nn.sharded_ddp.comm import all_gather_objects, broadcast_coalesced

#: (kind, name, shape, dtype) of one parameter or buffer; kind is "parameter" or "buffer".
TensorSignature = tuple[str, str, tuple[int, ...], str]


def model_signature(module: nn.Module) -> list[TensorSignature]:
    """The shape and dtype of every parameter and buffer of ``module``, in registration order."""
    signature: list[TensorSignature] = [
        ("parameter", name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()
    ]
    signature += [("buffer", name, tuple(b.shape), str(b.dtype)) for name, b in module.named_buffers()]
    return signature


def describe_mismatch(reference: list[TensorSignature], other: list[TensorSignature], rank: int) -> Optional[str]:
    """What first differs between rank 0's signature and rank ``rank``'s, or None when they agree."""
    for ref, mine in zip(reference, other):
        if ref == mine:
            continue
        kind, name, shape, dtype = mine
        if (ref[0], ref[1]) != (kind, name):
            return f"rank 0 has {ref[0]} '{ref[1]}' where rank {rank} has {kind} '{name}'"
        return (
            f"{kind} '{name}' has shape {list(shape)} and dtype {dtype} on rank {rank} but shape {list(ref[2])} and "
            f"dtype {ref[3]} on rank 0"
        )
    if len(reference) != len(other):
        longer, owner = (reference, 0) if len(reference) > len(other) else (other, rank)
        extra = longer[min(len(reference), len(other))]
        counts = f"{len(reference)} tensors on rank 0, {len(other)} on rank {rank}"
        return f"{extra[0]} '{extra[1]}' exists only on rank {owner} ({counts})"
    return None


def check_same_model(module: nn.Module, group: GroupLike) -> None:
    """Raise the same ValueError on every rank when any rank's parameters or buffers differ from rank 0's.

    One all-gather of the shapes, before any other collective, so a mismatch is reported instead of hanging
    or corrupting a later broadcast.
    """
    signatures = all_gather_objects(model_signature(module), group, "sdp_model_check")
    for rank, signature in enumerate(signatures[1:], start=1):
        problem = describe_mismatch(signatures[0], signature, rank)
        if problem is not None:
            raise ValueError(
                f"ShardedDataParallel: the ranks hold different models: {problem}. Build the same model on every "
                "rank before wrapping it (rank-specific parts, such as per-rank experts, need their own process "
                "group). Nothing was broadcast or changed."
            )


def sync_module_states(module: nn.Module, group: GroupLike, chunk_bytes: int) -> None:
    """Copy rank 0's parameters and buffers to every rank of ``group``."""
    tensors = [p.detach() for p in module.parameters()] + [b.detach() for b in module.buffers()]
    broadcast_coalesced(tensors, 0, group, chunk_bytes, "sdp_sync_model")
