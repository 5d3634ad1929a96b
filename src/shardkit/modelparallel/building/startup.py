"""What happens once, when the first step partitions the model: checks and the initial broadcast."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed import GroupLike, all_gather_objects
from shardkit.distributed import collectives as C
from shardkit.utils._torch_private import tree_leaves


def check_same_inputs(inputs: Any, mp_group: GroupLike) -> None:
    """The stages of a replica must see the same batch (each runs glue code on it): checked once, cheaply."""
    leaves = [x for x in tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    digest = [(tuple(x.shape), str(x.dtype), float(x.detach().double().sum())) for x in leaves]
    gathered = all_gather_objects(digest, mp_group, "smp_same_inputs")
    if any(d != gathered[0] for d in gathered):
        differing = [s for s, d in enumerate(gathered) if d != gathered[0]]
        raise ValueError(
            f"the stages of one model replica got different inputs (stages {differing} differ from stage 0): "
            "every rank of an mp group must pass the same batch to the @smp.step function (seed the data "
            "loader by dp_rank, not by rank)"
        )


def broadcast_initial_state(
    module: nn.Module,
    world_group: GroupLike,
    device: torch.device,
    split: Optional[tuple[frozenset[int], GroupLike]] = None,
) -> None:
    """Every rank starts from rank 0's parameters and buffers; tensor-parallel split parameters (``split``: their
    ids and the reduced-data-parallel group) from that group's first member instead.

    When the backend cannot send CPU tensors (NCCL), each tensor is staged through ``device`` on its own, so
    the whole model never has to fit there.
    """
    staging = device if dist.get_backend() == "nccl" else None
    ids, split_group = split if split is not None else (frozenset(), world_group)
    with torch.no_grad():
        for tensor in canonical_tensors(module).values():
            group = split_group if id(tensor) in ids else world_group
            if staging is None or tensor.device == staging:
                C.broadcast(tensor.data, 0, group=group, label="smp_initial_state")
            else:
                moved = tensor.data.to(staging)
                C.broadcast(moved, 0, group=group, label="smp_initial_state")
                tensor.data.copy_(moved)


def canonical_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor for every parameter and buffer (a tied tensor appears once, first name)."""
    named: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            named[name] = tensor
    return named
