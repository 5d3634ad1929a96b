"""What happens once, when the first step partitions the model: checks and the initial broadcast."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from shardkit.distributed import GroupLike
from shardkit.distributed import collectives as C
from shardkit.modelparallel.checkpoint import all_gather_objects


def check_same_inputs(inputs: Any, mp_group: GroupLike) -> None:
    """The stages of a replica must see the same batch (each runs glue code on it): checked once, cheaply."""
    leaves = [x for x in tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    digest = [(tuple(x.shape), str(x.dtype), float(x.detach().double().sum())) for x in leaves]
    gathered = all_gather_objects(digest, mp_group)
    if any(d != gathered[0] for d in gathered):
        differing = [s for s, d in enumerate(gathered) if d != gathered[0]]
        raise ValueError(
            f"the stages of one model replica got different inputs (stages {differing} differ from stage 0): "
            "every rank of an mp group must pass the same batch to the @smp.step function (seed the data "
            "loader by dp_rank, not by rank)"
        )


def model_fingerprint(module: nn.Module) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(kind, name, shape, dtype) of every parameter and buffer, in registration order."""
    params = [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    buffers = [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    return params + buffers


def check_same_model(module: nn.Module, world_group: GroupLike) -> None:
    """Every rank must have built the same model before rank 0's tensors are broadcast into it.

    Ranks first compare a digest of :func:`model_fingerprint` (a few bytes each); only when digests differ are
    the full lists gathered to name the first difference. Raises the same ``ValueError`` on every rank.
    """
    fingerprint = model_fingerprint(module)
    digest = hashlib.sha256(repr(fingerprint).encode()).hexdigest()
    digests = all_gather_objects(digest, world_group)
    if all(d == digests[0] for d in digests):
        return
    everyone = all_gather_objects(fingerprint, world_group)
    raise ValueError(_first_model_difference(everyone))


def _first_model_difference(fingerprints: list[list[tuple[str, str, tuple[int, ...], str]]]) -> str:
    reference = fingerprints[0]
    for rank, other in enumerate(fingerprints[1:], start=1):
        if other == reference:
            continue
        for position in range(max(len(reference), len(other))):
            mine = reference[position] if position < len(reference) else None
            theirs = other[position] if position < len(other) else None
            if mine == theirs:
                continue
            what = _describe(mine, theirs, rank, position)
            break
        return (
            f"ranks built different models: {what}. smp broadcasts rank 0's parameters into every rank's model, "
            "so every rank must construct the same module (same classes, sizes, dtypes and registration order) "
            "before smp.DistributedModel; make the model's construction independent of the rank"
        )
    return "ranks built different models"  # pragma: no cover  (digests differed, so some list differs)


def _describe(mine: Any, theirs: Any, rank: int, position: int) -> str:
    if mine is None:
        return f"rank {rank} has an extra {theirs[0]} {theirs[1]!r} that rank 0 does not have"
    if theirs is None:
        return f"rank 0 has {mine[0]} {mine[1]!r} that rank {rank} does not have"
    if mine[:2] != theirs[:2]:
        return (
            f"tensor #{position} of the model is {mine[0]} {mine[1]!r} on rank 0 but {theirs[0]} {theirs[1]!r} "
            f"on rank {rank}"
        )
    return f"{mine[0]} {mine[1]!r} is {_spec(mine)} on rank 0 but {_spec(theirs)} on rank {rank}"


def _spec(entry: Any) -> str:
    return f"shape {tuple(entry[2])} {entry[3].removeprefix('torch.')}"


def broadcast_initial_state(module: nn.Module, world_group: GroupLike, device: torch.device) -> None:
    """Every rank starts from rank 0's parameters and buffers.

    When the backend cannot send CPU tensors (NCCL), each tensor is staged through ``device`` on its own, so
    the whole model never has to fit there.
    """
    staging = device if dist.get_backend() == "nccl" else None
    with torch.no_grad():
        for tensor in canonical_tensors(module).values():
            if staging is None or tensor.device == staging:
                C.broadcast(tensor.data, 0, group=world_group, label="smp_initial_state")
            else:
                moved = tensor.data.to(staging)
                C.broadcast(moved, 0, group=world_group, label="smp_initial_state")
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
