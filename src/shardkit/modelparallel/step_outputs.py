"""What an ``@smp.step`` call returns: every micro-batch's value of every leaf, the output stage's on every rank.

Two pieces. :func:`share_from_output_stage` replaces what this stage's step function returned by what the output
stage's returned: only there is the model's output real (other stages computed the loss from placeholder zeros).
:func:`gather_microbatch_outputs` then turns the per-micro-batch results into one structure: each tensor leaf a
:class:`StepOutput`, each other leaf (``loss.item()``, a correct-count, a string, ``None``) a list of its
per-micro-batch values, as smp documents ("returns lists instead of StepOutput objects" for scalars).

Cost: tensors travel in one broadcast per dtype over the replica's stages, shaped as this stage's own outputs.
When a non-tensor leaf exists, one small pickled object goes first (the output stage's structure, its non-tensor
values and its tensors' shapes), so nothing on another stage is taken from placeholder outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from shardkit.distributed import GroupLike, broadcast_object
from shardkit.modelparallel.pp_communications import broadcast_tensors


class StepOutput:
    """One returned tensor's value for every micro-batch of an ``@smp.step`` call.

    Example::

        loss = train_step(model, x, y)      # a StepOutput
        print(loss.reduce_mean().item())    # the mean over micro-batches
    """

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs
        """The per-micro-batch values, in micro-batch order."""

    def reduce_mean(self) -> torch.Tensor:
        """The mean over micro-batches."""
        return self.reduce_sum() / len(self.outputs)

    def reduce_sum(self) -> torch.Tensor:
        """The sum over micro-batches."""
        return torch.stack(self.outputs).sum(dim=0)

    def concat(self) -> torch.Tensor:
        """The micro-batch values concatenated along the batch axis (axis 0)."""
        return torch.cat(self.outputs, dim=0)

    def stack(self) -> torch.Tensor:
        """The micro-batch values stacked along a new leading axis."""
        return torch.stack(self.outputs, dim=0)

    def __repr__(self) -> str:
        return f"StepOutput({len(self.outputs)} microbatches)"


def _flatten(value: Any) -> tuple[list[Any], TreeSpec]:
    # None is a leaf here (pytree would drop it): a step returning None for a metric gets [None] * microbatches.
    return tree_flatten(value, is_leaf=lambda v: v is None)


class _TensorMeta:
    """Stands for a tensor leaf in the object the output stage broadcasts: what the receivers allocate."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def share_from_output_stage(
    outputs: list[Any], output_stage: int, group: GroupLike, num_stages: int, device: torch.device, detach: bool
) -> list[Any]:
    """``outputs`` (this stage's per-micro-batch results) replaced by the output stage's, on every stage.

    ``group`` joins the replica's stages (stage ``k`` is member ``k``); ``device`` is where this stage allocates
    the tensors it receives. Collective over ``group`` when ``num_stages`` > 1: every stage's step function must
    return the same kinds of leaves (tensors where the output stage returns tensors).
    """
    leaves, spec = _flatten(outputs)
    leaves = [x.detach() if detach and isinstance(x, torch.Tensor) else x for x in leaves]
    if num_stages == 1:
        return tree_unflatten(leaves, spec)
    if any(not isinstance(x, torch.Tensor) for x in leaves):
        described = [_TensorMeta(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        spec, described = broadcast_object((spec, described), output_stage, group, label="smp_step_outputs")
        leaves = [
            mine if isinstance(theirs, _TensorMeta) and _same_meta(mine, theirs) else _take(theirs, device)
            for mine, theirs in zip(_padded(leaves, len(described)), described)
        ]
    index = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    shared = broadcast_tensors([leaves[i] for i in index], output_stage, group, label="smp_step_outputs")
    for i, tensor in zip(index, shared):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


def _padded(leaves: list[Any], n: int) -> list[Any]:
    return (leaves + [None] * n)[:n]


def _same_meta(mine: Any, theirs: _TensorMeta) -> bool:
    return isinstance(mine, torch.Tensor) and tuple(mine.shape) == theirs.shape and mine.dtype == theirs.dtype


def _take(theirs: Any, device: torch.device) -> Any:
    # A tensor leaf whose shape differs here gets a fresh buffer of the output stage's shape; other leaves are
    # the output stage's values themselves.
    return theirs.empty(device) if isinstance(theirs, _TensorMeta) else theirs


def gather_microbatch_outputs(per_mb: list[Any]) -> Any:
    """One structure from the per-micro-batch results: tensors as :class:`StepOutput`, other leaves as lists.

    Raises ``ValueError`` when micro-batches returned different structures, or a tensor in one and not another.

    Example::

        >>> gather_microbatch_outputs([(0.5, 1), (0.25, 3)])
        ([0.5, 0.25], [1, 3])
    """
    leaves0, spec = _flatten(per_mb[0])
    columns = []
    for mb, out in enumerate(per_mb):
        leaves, mb_spec = _flatten(out)
        if mb_spec != spec:
            raise ValueError(
                f"the @smp.step function returned a different structure in micro-batch {mb} than in micro-batch 0 "
                f"({mb_spec} vs {spec}): return the same containers and keys for every micro-batch"
            )
        columns.append(leaves)
    merged = []
    for i, leaf in enumerate(leaves0):
        values = [col[i] for col in columns]
        kinds = {isinstance(v, torch.Tensor) for v in values}
        if len(kinds) > 1:
            first = "a tensor" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            other = next(
                mb for mb, v in enumerate(values) if isinstance(v, torch.Tensor) != isinstance(leaf, torch.Tensor)
            )
            raise ValueError(
                f"the @smp.step function returned {first} in micro-batch 0 but {type(values[other]).__name__} in "
                f"micro-batch {other} at the same place: return a tensor for every micro-batch or for none"
            )
        merged.append(StepOutput(values) if isinstance(leaf, torch.Tensor) else values)
    return tree_unflatten(merged, spec)
