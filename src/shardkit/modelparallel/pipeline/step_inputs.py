"""The ``@smp.step`` arguments of a replica's stages: equal, or empty placeholders beside the first stage's data.

smp runs the model's forward from the first pipeline stage: the inputs that count are the ones given on the rank
with ``pp_rank() == 0``. AWS's example scripts rely on it: they load data only there and give the other stages a
dataset of empty tensors of the same length (``torch.Tensor(0)`` per sample). Here every stage runs the step
function and the model's glue code on its own arguments, so such placeholders are filled in instead: an empty
tensor argument (no elements) on a later stage, where the first stage has data, is replaced by the first stage's
tensor, broadcast over the replica before the step runs. Any other argument must be the same on every stage:
checked at the first call, and a difference is refused on every rank, as before.

The decision is made at a decorated function's first call (one object all-gather over the replica); from then on
only functions that got placeholders pay the broadcast (plus a small all-gather of shapes) at each call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardkit.distributed import all_gather_objects
from shardkit.distributed.device import current_cuda_device
from shardkit.modelparallel.pipeline.pp_communications import broadcast_tensors
from shardkit.modelparallel.state import SMPState
from shardkit.utils._torch_private import tree_flatten, tree_unflatten

#: One tensor argument as a stage describes it: shape, dtype, and a sum of its values (for the equality check).
Leaf = tuple[tuple[int, ...], str, float]


@dataclass
class StageInputs:
    """Per decorated function and model: whether later stages take the first stage's tensors (see module doc)."""

    decided: bool = False
    fills: bool = False

    def align(self, arguments: dict[str, Any], state: SMPState, where: str) -> dict[str, Any]:
        """``arguments`` (a bound call's, by name) with this stage's placeholders replaced; collective over the
        replica's stages on the first call and, when placeholders were seen, on every call."""
        if not state.distributed or state.topology.mp_size == 1 or (self.decided and not self.fills):
            return arguments
        leaves, spec = tree_flatten(arguments)
        tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        mine = [_describe(leaves[i], digest=not self.decided) for i in tensors]
        every = all_gather_objects(mine, state.mp_group, "smp_step_inputs")
        if not self.decided:
            _check_agreement(every, where)
            self.decided = True
            self.fills = any(_placeholder(stage[i], every[0][i]) for stage in every[1:] for i in range(len(mine)))
            if not self.fills:
                return arguments
        _check_counts(every, where)
        wanted = [k for k in range(len(mine)) if any(_placeholder(stage[k], every[0][k]) for stage in every[1:])]
        if not wanted:
            return arguments
        stage = state.topology.mp_rank
        device = current_cuda_device() if dist.get_backend() == "nccl" else torch.device("cpu")
        buffers = [
            leaves[tensors[k]].to(device)
            if stage == 0
            else torch.empty(every[0][k][0], dtype=_dtype(every[0][k][1]), device=device)
            for k in wanted
        ]
        filled = broadcast_tensors(buffers, 0, state.mp_group, "smp_step_inputs")
        if stage == 0:
            return arguments
        for k, value in zip(wanted, filled):
            if _placeholder(mine[k], every[0][k]):
                leaves[tensors[k]] = value
        return tree_unflatten(leaves, spec)


def _describe(x: torch.Tensor, digest: bool) -> Leaf:
    total = float(x.detach().double().sum()) if digest and x.numel() else 0.0
    return (tuple(x.shape), str(x.dtype).removeprefix("torch."), total)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _placeholder(leaf: Leaf, first: Leaf) -> bool:
    """An empty tensor where the first stage has data."""
    return _numel(leaf[0]) == 0 and _numel(first[0]) > 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _check_counts(every: list[list[Leaf]], where: str) -> None:
    counts = [len(stage) for stage in every]
    if len(set(counts)) > 1:
        raise ValueError(
            f"the stages of one model replica passed a different number of tensor arguments to {where} "
            f"(per stage: {counts}): pass the same arguments on every stage (empty tensors where a stage has no data)"
        )


def _check_agreement(every: list[list[Leaf]], where: str) -> None:
    """Every stage's tensors equal the first stage's, except empty placeholders (raised on every rank)."""
    _check_counts(every, where)
    differing = sorted(
        {
            s
            for s, stage in enumerate(every)
            for leaf, first in zip(stage, every[0])
            if leaf != first and not _placeholder(leaf, first)
        }
    )
    if differing:
        raise ValueError(
            f"the stages of one model replica got different inputs (stages {differing} differ from stage 0) in "
            f"{where}: every rank of an mp group must pass the same batch to the @smp.step function (seed the data "
            "loader by dp_rank, not by rank), or, as smp's examples do, an empty tensor (torch.Tensor(0) per sample) "
            "on the stages after the first, which then take the first stage's"
        )
