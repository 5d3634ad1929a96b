"""What an ``@smp.step`` call returns: every micro-batch's value of every leaf, the output stage's on every rank.

Two pieces. :func:`share_from_output_stage` replaces what this stage's step function returned by what the output
stage's returned: only there is the model's output real (other stages computed the loss from placeholder zeros).
:func:`gather_microbatch_outputs` then turns the per-micro-batch results into one structure: each tensor leaf a
:class:`StepOutput`, each other leaf (``loss.item()``, a correct-count, a string, ``None``) a list of its
per-micro-batch values, as smp documents ("returns lists instead of StepOutput objects" for scalars).

Cost: tensors travel in one broadcast per dtype over the replica's stages, shaped as this stage's own outputs.
When a non-tensor leaf exists, one small pickled object goes first (the output stage's structure, its non-tensor
values and its tensors' shapes), so nothing on another stage is taken from placeholder outputs. The first call of
each step function also compares the stages' output layouts once (one all-gather): a tensor whose shape depends
on the model output's values (``logits[logits > 0]``) has another shape where the output is a placeholder, and
that step function then always sends the structure first.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Optional

import torch

from shardkit.distributed import GroupLike, all_gather_objects, broadcast_object, group_rank
from shardkit.modelparallel.pipeline.pp_communications import broadcast_tensors
from shardkit.utils._torch_private import TreeSpec, tree_flatten, tree_unflatten


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


@dataclass
class OutputSharing:
    """What one ``@smp.step`` function's first call taught about its outputs (kept for its later calls)."""

    #: The stages compared what they return (shapes, dtypes, structure) once, on the first call.
    checked: bool = False
    #: They differed (a tensor whose shape depends on the model output's values, computed from placeholders on
    #: the other stages): every call then sends the output stage's structure first, as with non-tensor leaves.
    describe_always: bool = False


def _layout(spec: TreeSpec, leaves: list[Any]) -> tuple[Any, ...]:
    # What must agree for the tensor broadcast to line up; non-tensor values may differ (they are replaced).
    kinds = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else "value" for x in leaves)
    return (str(spec), kinds)


def share_from_output_stage(
    outputs: list[Any],
    output_stage: int,
    group: GroupLike,
    num_stages: int,
    device: torch.device,
    detach: bool,
    sharing: Optional[OutputSharing] = None,
) -> list[Any]:
    """``outputs`` (this stage's per-micro-batch results) replaced by the output stage's, on every stage.

    ``group`` joins the replica's stages (stage ``k`` is member ``k``); ``device`` is where this stage allocates
    the tensors it receives; ``sharing`` carries what earlier calls of the same step function learned (a fresh
    one checks again). Collective over ``group`` when ``num_stages`` > 1. The first call compares every stage's
    output layout (one all-gather); when they differ, or a leaf is not a tensor, the output stage's structure
    travels first, so nothing is taken from placeholder outputs.
    """
    sharing = sharing if sharing is not None else OutputSharing()
    leaves, spec = _flatten(outputs)
    leaves = [x.detach() if detach and isinstance(x, torch.Tensor) else x for x in leaves]
    if num_stages == 1:
        return tree_unflatten(leaves, spec)
    if not sharing.checked:
        layouts = all_gather_objects(_layout(spec, leaves), group, "smp_step_output_layout")
        sharing.checked = True
        sharing.describe_always = any(layout != layouts[0] for layout in layouts)
    if sharing.describe_always or any(not isinstance(x, torch.Tensor) for x in leaves):
        described = [_TensorMeta(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        # The output stage checks its values can be sent, and sends a refusal in their place if not: every stage
        # then raises the same error, instead of the others reading "connection closed" when it fails alone.
        payload = _sendable(spec, described) if group_rank(group) == output_stage else (spec, described)
        payload = broadcast_object(payload, output_stage, group, label="smp_step_outputs")
        if isinstance(payload, _Unsendable):
            raise TypeError(payload.message)
        spec, described = payload
        leaves = [
            mine if isinstance(theirs, _TensorMeta) and _same_meta(mine, theirs) else _take(theirs, device)
            for mine, theirs in zip(_padded(leaves, len(described)), described)
        ]
    index = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    shared = broadcast_tensors([leaves[i] for i in index], output_stage, group, label="smp_step_outputs")
    for i, tensor in zip(index, shared):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


class _Unsendable:
    """Sent by the output stage in place of values that cannot be pickled: the error every stage raises."""

    def __init__(self, message: str) -> None:
        self.message = message


def _sendable(spec: TreeSpec, described: list[Any]) -> Any:
    """``(spec, described)``, or an :class:`_Unsendable` naming the first value pickle refuses."""
    try:
        pickle.dumps((spec, described))
        return spec, described
    except Exception:
        pass
    for place, value in zip(_places(spec), described):
        try:
            pickle.dumps(value)
        except Exception as err:
            return _Unsendable(
                f"the @smp.step function returned {value!r} (a {type(value).__name__}) at {place}, which cannot be "
                f"sent from the output stage to the other stages ({type(err).__name__}: {err}). Return tensors and "
                "plain values (numbers, strings, None, containers of them) from the step; build anything else "
                "from them after the step returns."
            )
    return _Unsendable(f"the @smp.step function's return value cannot be sent between stages: {spec}")


def _places(spec: TreeSpec) -> list[str]:
    """Where each leaf sits in the returned value, as ``micro-batch 0, result[1]['acc']``."""
    marked = tree_unflatten(list(range(spec.num_leaves)), spec)
    places: list[str] = [""] * spec.num_leaves
    for mb, result in enumerate(marked):
        _walk(result, "result", lambda index, path, mb=mb: places.__setitem__(index, f"micro-batch {mb}, {path}"))
    return places


def _walk(value: Any, path: str, found: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool):
        found(value, path)
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(item, f"{path}[{key!r}]", found)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", found)


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
