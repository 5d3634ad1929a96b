"""At wrap time the ranks agree on a unit's tensors: the same shapes (else refuse), then the same values (else rank
0's, as DDP does at construction).

FSDP keeps, on each rank, that rank's slice of the parameters the rank built. Ranks that built the same model with
different values (pretrained weights loaded on rank 0 only, ``torch.manual_seed(rank)`` before building) would
train a patchwork of their models without a word. So the ranks compare checksums of every parameter and buffer the
unit owns (:func:`~shardkit.distributed.model_check.value_checksums`), in the one all-gather the wrap already makes
to compare shapes, and only the tensors that differ are broadcast from member 0 of the unit's group; for hybrid
sharding and ``NO_SHARD`` then from member 0 of its replica group (one more small all-gather of checksums), so every
rank ends with global rank 0's values. When the ranks agree (the usual case) the cost is the checksums (one pass
over the unit's tensors where they live, no copies) and a few more bytes in the existing all-gather.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.device import current_cuda_device
from shardkit.distributed.groups import GroupLike, group_size
from shardkit.distributed.model_check import value_checksums
from shardkit.distributed.objects import all_gather_objects
from shardkit.nn.fsdp._collectives import broadcast_start_values
from shardkit.nn.fsdp.flat_param import Aliases, Owners

_LOG = logging.getLogger("shardkit.nn.fsdp")


def agree_at_wrap(
    owners: Owners,
    aliases: Aliases,
    buffers: list[tuple[str, torch.Tensor]],
    group: GroupLike,
    replica: Optional[GroupLike],
    rank: int,
    stage_on: torch.device,
    label: str = "",
) -> None:
    """Refuse (on every rank, nothing changed) ranks whose parameters differ in name, shape or dtype; give every
    rank rank 0's values of the tensors whose values differ. ``stage_on``: where a broadcast runs (the unit's
    compute device: NCCL cannot broadcast CPU tensors); ``label`` names the wrapped module in the log line."""
    signature = [(loc.fqn, tuple(p.shape), str(p.dtype)) for loc, p in owners]
    signature += [(loc.fqn, (), "") for loc, _ in aliases]
    signature += [(f"{name} (buffer)", tuple(b.shape), str(b.dtype)) for name, b in buffers]
    named = [(loc.fqn, p) for loc, p in owners] + buffers
    compare = group_size(group) > 1 or replica is not None
    sums = value_checksums([t for _, t in named]) if compare else []
    everyone = all_gather_objects((signature, sums), group, "fsdp:param_check")
    _refuse_other_shapes(signature, [s for s, _ in everyone], rank)
    reference = everyone[0][1]
    differ = _differing(reference, [theirs for _, theirs in everyone])
    replica_differ: list[int] = []
    if replica is not None:  # after the broadcast below, every rank of the group holds ``reference``
        replica_differ = _differing(reference, all_gather_objects(reference, replica, "fsdp:replica_value_check"))
    _broadcast([named[i][1] for i in differ], group, stage_on, label)
    _broadcast([named[i][1] for i in replica_differ], replica, stage_on, f"{label}:replicas")
    if differ or replica_differ:
        names = sorted({named[i][0] for i in differ + replica_differ})
        _LOG.info(
            "FullyShardedDataParallel (unit wrapping %s): the ranks held different values of %d tensor(s) (%s%s); "
            "every rank now holds rank 0's, as DDP does at construction",
            label or "a module",
            len(names),
            ", ".join(names[:3]),
            ", ..." if len(names) > 3 else "",
        )


def _refuse_other_shapes(mine: list[Any], everyone: list[list[Any]], rank: int) -> None:
    for other_rank, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        for a, b in zip(mine, theirs):
            if a != b:
                detail = f"'{a[0]}' {a[1]} {a[2]} on rank {rank} but '{b[0]}' {b[1]} {b[2]} on rank {other_rank}"
                break
        else:
            detail = f"{len(mine)} parameters and buffers on rank {rank} but {len(theirs)} on rank {other_rank}"
        raise ValueError(
            f"FullyShardedDataParallel: ranks hold different parameters: {detail}. Every rank must build the same "
            "model (same parameter and buffer names, shapes and dtypes) before wrapping; the model was left "
            "unchanged."
        )


def _differing(reference: Sequence[Any], everyone: Sequence[Sequence[Any]]) -> list[int]:
    """Indices where some member's checksum is not member 0's (the same list on every member)."""
    return [i for i in range(len(reference)) if any(theirs[i] != reference[i] for theirs in everyone)]


@torch.no_grad()
def _broadcast(tensors: list[torch.Tensor], group: Optional[GroupLike], stage_on: torch.device, label: str) -> None:
    """Overwrite ``tensors`` in place with member 0's values (all issued, then all waited on)."""
    if not tensors or group is None:
        return
    if stage_on.type == "cpu" and isinstance(group, dist.ProcessGroup) and dist.get_backend(group) == "nccl":
        stage_on = current_cuda_device()  # a CPU model wrapped for a later .cuda(): NCCL moves CUDA tensors only
    pending = []
    for tensor in tensors:
        wire = tensor.detach()
        if wire.device != stage_on or not wire.is_contiguous():
            wire = wire.to(stage_on, copy=True).contiguous()
        handle = broadcast_start_values(wire, group, label)
        pending.append((handle, tensor, wire))
    for handle, tensor, wire in pending:
        handle.wait()
        if wire.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(wire)
