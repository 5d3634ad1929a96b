"""The pipeline plan: which module calls run on which stage, and which of their outputs each stage needs.

Units are the largest subtrees whose modules all sit on one stage; a module whose subtree spans stages is
*opened*: its own forward code (the "glue" between its children: residual adds, reshapes, loops) runs on every
stage, and its direct parameters are replicated. A unit call runs only on its stage; elsewhere it returns
either the real outputs (received from the owner) or zero placeholders of the right shape.

Which stages need which outputs is found by running the model once more with a ``TorchFunctionMode`` that
follows every glue operator: each tensor remembers the unit outputs it was computed from. A stage receives a
unit output when a unit it owns consumes a tensor computed from it, and the output stage (where the loss is
computed) receives everything the model's outputs are computed from. Everything else a stage computes from
placeholders is never used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from shardkit.modelparallel.partitioning.trace import side_effect_free
from shardkit.utils._torch_private import TreeSpec, tree_flatten, tree_leaves

Source = tuple[int, int]  # (unit call index, output leaf index)


@dataclass(frozen=True)
class LeafSpec:
    """Shape and dtype of one tensor output of a unit call."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class UnitCall:
    """One call of a unit module during a forward, in execution order."""

    index: int
    unit: str
    stage: int
    treespec: TreeSpec
    #: Per output leaf: the traced value of a non-tensor leaf (tensor leaves hold None).
    constants: tuple[Any, ...]
    is_tensor: tuple[bool, ...]
    #: Per output leaf: the other stages that receive it, ascending.
    consumers: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class PipelinePlan:
    """Everything every rank needs to run its part of the model; computed once, on rank 0, and broadcast."""

    mp_size: int
    #: Unit module name -> stage.
    units: dict[str, int]
    calls: tuple[UnitCall, ...]
    #: The stage where the model's outputs are real (the loss is computed and backward starts there).
    output_stage: int
    #: Parameters and buffers every stage holds: direct state of opened modules, and unit parameters that opened
    #: modules' code uses directly.
    replicated: frozenset[str]
    #: Parameter/buffer name -> stages holding it (several for shared or replicated ones).
    holders: dict[str, tuple[int, ...]]
    #: True when activations only flow to higher stages (needed for the 1F1B schedule).
    monotone: bool
    signature: tuple[Any, ...]
    #: Per call, per output leaf: the traced tensor spec (None for non-tensor leaves).
    shapes: tuple[tuple[Optional[LeafSpec], ...], ...]

    def stage_edges(self) -> set[tuple[int, int]]:
        """(producer stage, consumer stage) pairs that carry activations."""
        return {(c.stage, dst) for c in self.calls for leaf in c.consumers for dst in leaf}


def signature_of(args: Any) -> tuple[Any, ...]:
    """What must stay the same for traced shapes to stay valid: tensor shapes/dtypes and non-tensor types."""
    return tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__ for x in tree_leaves(args)
    )


def _has_direct_state(module: nn.Module) -> bool:
    return bool(module._parameters) or bool(module._buffers) or not module._modules


def derive_units(root: nn.Module, stage_of: dict[str, int]) -> dict[str, int]:
    """Units (largest single-stage subtrees) from the stage of each module that holds state or is a leaf.

    ``stage_of`` may name any modules; only those with direct parameters/buffers, or without children,
    decide. Modules that decide nothing (an empty container) join their neighbours.
    """
    stages: dict[str, set[int]] = {}

    def collect(name: str, module: nn.Module) -> set[int]:
        found = {stage_of[name]} if name in stage_of and _has_direct_state(module) else set()
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if full not in stages:
                found |= collect(full, child)
        stages[name] = found
        return found

    collect("", root)
    units: dict[str, int] = {}

    def pick(name: str, module: nn.Module) -> None:
        found = stages.get(name, set())
        if len(found) == 1:
            units[name] = next(iter(found))
            return
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if full in stages and full not in units:
                pick(full, child)

    pick("", root)
    if not units:  # a model with no parameters and no leaves: run it whole on stage 0
        units[""] = 0
    return units


@dataclass
class _Recorder:
    """Mutable bookkeeping of the dataflow trace."""

    units: dict[str, int]
    unit_param_names: dict[int, str]
    depth: int = 0
    sources: dict[int, frozenset[Source]] = field(default_factory=dict)
    keepalive: list[Any] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    glue_used: set[str] = field(default_factory=set)

    def sources_of(self, value: Any) -> frozenset[Source]:
        """The unit outputs every tensor in ``value`` was computed from."""
        found: set[Source] = set()
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                found |= self.sources.get(id(leaf), frozenset())
        return frozenset(found)

    def consume(self, srcs: frozenset[Source], stage: int) -> None:
        """``stage`` needs these unit outputs: it becomes a consumer of those computed elsewhere."""
        for call_index, leaf in srcs:
            if self.calls[call_index]["stage"] != stage:
                self.calls[call_index]["consumers"][leaf].add(stage)

    def record_call(self, unit: str, stage: int, out: Any) -> tuple[Optional[LeafSpec], ...]:
        """Record a unit call's outputs and tag each as a source; returns their specs."""
        leaves, spec = tree_flatten(out)
        index = len(self.calls)
        is_tensor = tuple(isinstance(x, torch.Tensor) for x in leaves)
        self.calls.append(
            dict(
                index=index,
                unit=unit,
                stage=stage,
                treespec=spec,
                constants=tuple(None if t else x for x, t in zip(leaves, is_tensor)),
                is_tensor=is_tensor,
                consumers=[set() for _ in leaves],
            )
        )
        for i, (x, t) in enumerate(zip(leaves, is_tensor)):
            if t:
                self.sources[id(x)] = frozenset({(index, i)})
                self.keepalive.append(x)
        return tuple(LeafSpec(tuple(x.shape), x.dtype) if t else None for x, t in zip(leaves, is_tensor))


class _GlueMode(TorchFunctionMode):
    """Propagates unit-output provenance through every operator that runs outside units."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec = self.rec
        if rec.depth == 0:
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            for t in inputs:
                name = rec.unit_param_names.get(id(t))
                if name is not None:
                    rec.glue_used.add(name)
            srcs = rec.sources_of(inputs)
            if srcs:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        rec.sources[id(t)] = srcs | rec.sources.get(id(t), frozenset())
                        rec.keepalive.append(t)
        return out


def _state_names(module: nn.Module) -> dict[int, str]:
    """id of every parameter and buffer -> its canonical (first) name."""
    names: dict[int, str] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        names.setdefault(id(tensor), name)
    return names


def build_plan(
    root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], units: dict[str, int], mp_size: int
) -> PipelinePlan:
    """Trace ``root(*args, **kwargs)`` once and derive the :class:`PipelinePlan` for ``units``."""
    names = _state_names(root)
    unit_param_names = {
        id(t): names[id(t)]
        for u in units
        for t in [*root.get_submodule(u).parameters(), *root.get_submodule(u).buffers()]
        if u  # a root unit has no glue around it
    }
    rec = _Recorder(units, unit_param_names)
    unit_of = {id(root.get_submodule(u)): u for u in units}
    shapes: list[tuple[Optional[LeafSpec], ...]] = []

    def pre(module: nn.Module, a: Any, kw: Any) -> None:
        if rec.depth == 0:
            stage = units[unit_of[id(module)]]
            rec.consume(rec.sources_of((a, kw)), stage)
        rec.depth += 1

    def post(module: nn.Module, a: Any, kw: Any, out: Any) -> None:
        rec.depth -= 1
        if rec.depth == 0:
            name = unit_of[id(module)]
            shapes.append(rec.record_call(name, units[name], out))

    handles = []
    for u in units:
        m = root.get_submodule(u)
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        with side_effect_free(root), _GlueMode(rec):
            out = root(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    out_sources = rec.sources_of(out)
    stages = [rec.calls[c]["stage"] for c, _ in out_sources]
    output_stage = max(stages) if stages else mp_size - 1
    rec.consume(out_sources, output_stage)
    return _finish(root, units, rec, shapes, output_stage, mp_size, signature_of((args, kwargs)))


def _finish(
    root: nn.Module,
    units: dict[str, int],
    rec: _Recorder,
    shapes: list[tuple[Optional[LeafSpec], ...]],
    output_stage: int,
    mp_size: int,
    signature: tuple[Any, ...],
) -> PipelinePlan:
    names = _state_names(root)
    holders: dict[str, set[int]] = {}
    for u, stage in units.items():
        module = root.get_submodule(u)
        for t in [*module.parameters(), *module.buffers()]:
            holders.setdefault(names[id(t)], set()).add(stage)
    replicated = set(rec.glue_used) | (set(names.values()) - set(holders))
    for name in replicated:
        holders[name] = set(range(mp_size))
    calls = tuple(
        UnitCall(
            c["index"],
            c["unit"],
            c["stage"],
            c["treespec"],
            c["constants"],
            c["is_tensor"],
            tuple(tuple(sorted(s)) for s in c["consumers"]),
        )
        for c in rec.calls
    )
    monotone = all(dst > c.stage for c in calls for leaf in c.consumers for dst in leaf)
    return PipelinePlan(
        mp_size,
        dict(units),
        calls,
        output_stage,
        frozenset(replicated),
        {k: tuple(sorted(v)) for k, v in holders.items()},
        monotone,
        signature,
        tuple(shapes),
    )
