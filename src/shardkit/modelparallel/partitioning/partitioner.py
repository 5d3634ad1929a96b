"""From a model and one micro-batch to a pipeline plan: trace, assign stages (auto or manual), derive units.

:func:`plan_partition` is what ``DistributedModel`` runs on rank 0 at the first step; it needs no process
group, so it also previews a partition in a plain Python session.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Union

import torch
from torch import nn

from shardkit.modelparallel.partition import manual_assignment
from shardkit.modelparallel.partitioning.auto_partition import Placement, auto_assignment, describe
from shardkit.modelparallel.partitioning.meta_values import MetaValues, to_meta_with_values
from shardkit.modelparallel.partitioning.plan import PipelinePlan, build_plan, derive_units
from shardkit.modelparallel.partitioning.trace import to_device, trace_costs, traced_on
from shardkit.utils._torch_private import tree_leaves


def _auto_stage_of(root: nn.Module, atoms: dict[str, int], default_partition: int) -> dict[str, int]:
    """Every module under an atom gets the atom's stage; modules outside atoms (and not above one) the default."""
    stage_of: dict[str, int] = {}
    above_atoms: set[str] = set()
    for atom in atoms:
        parts = atom.split(".") if atom else []
        above_atoms.update(".".join(parts[:i]) for i in range(len(parts)))
    for name, _ in root.named_modules():
        if name not in above_atoms:
            stage_of[name] = default_partition
    for atom, stage in atoms.items():
        for sub, _ in root.get_submodule(atom).named_modules():
            stage_of[f"{atom}.{sub}" if atom and sub else atom or sub] = stage
    return stage_of


def plan_partition(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Optional[dict[str, Any]] = None,
    *,
    partitions: int,
    auto_partition: bool = True,
    default_partition: int = 0,
    memory_weight: float = 0.8,
    measure_time: bool = False,
    measure_memory: bool = False,
    trace_device: Optional[Union[str, torch.device]] = None,
) -> tuple[PipelinePlan, Placement]:
    """Trace ``module(*args, **kwargs)`` and decide its pipeline partition; nothing is communicated.

    ``measure_time``/``measure_memory`` measure each module's time/activation memory in extra forwards
    instead of estimating them. ``trace_device`` runs the trace there (the model and inputs are copied for
    it and the model is left where it was); None traces where the parameters are.

    Example::

        plan, placement = plan_partition(model, (tokens,), partitions=2, trace_device="cpu")
        print(placement)
    """
    kwargs = kwargs or {}
    if trace_device is None:
        first = next(iter(module.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
    else:
        device = torch.device(trace_device)
    values: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    real_inputs = any(isinstance(t, torch.Tensor) and not t.is_meta for t in tree_leaves((args, kwargs)))
    if device.type == "meta" and real_inputs:  # a delayed model: the inputs' values stay known beside meta copies
        args, kwargs = to_meta_with_values((args, kwargs))
        values = MetaValues()
    else:
        args, kwargs = to_device((args, kwargs), device)
    with traced_on(module, device), values:
        return _plan(
            module,
            args,
            kwargs,
            partitions,
            auto_partition,
            default_partition,
            memory_weight,
            measure_time,
            measure_memory,
            str(device),
        )


def _plan(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    partitions: int,
    auto_partition: bool,
    default_partition: int,
    memory_weight: float,
    measure_time: bool,
    measure_memory: bool,
    traced_on: str,
) -> tuple[PipelinePlan, Placement]:
    costs = trace_costs(module, args, kwargs, measure_time=measure_time, measure_memory=measure_memory)
    if auto_partition:
        atoms = auto_assignment(costs, partitions, memory_weight)
        stage_of = _auto_stage_of(module, atoms, default_partition)
    else:
        stage_of = manual_assignment(module, partitions, default_partition)
    units = derive_units(module, stage_of)
    plan = build_plan(module, args, kwargs, units, partitions)
    if auto_partition and not plan.monotone:
        # Opening a big module exposed a child used out of order; place whole top-level modules instead.
        atoms = auto_assignment(costs, partitions, memory_weight, open_big=False)
        units = derive_units(module, _auto_stage_of(module, atoms, default_partition))
        plan = build_plan(module, args, kwargs, units, partitions)
    placement = describe(costs, units, partitions, memory_weight, auto_partition, traced_on)
    return plan, placement


def check_plan(plan: PipelinePlan) -> None:
    """Reject plans the pipeline cannot run: activations must only flow to later stages."""
    if plan.monotone:
        return
    backward = sorted(
        {(c.unit, c.stage, dst) for c in plan.calls for leaf in c.consumers for dst in leaf if dst < c.stage}
    )
    unit, src, dst = backward[0]
    raise ValueError(
        f"the partition sends activations backwards: outputs of {unit!r} (stage {src}) are used on stage {dst}. "
        "A pipeline needs every stage to feed only later stages: place modules on non-decreasing stages in the "
        "order the forward calls them (or use auto_partition)"
    )
