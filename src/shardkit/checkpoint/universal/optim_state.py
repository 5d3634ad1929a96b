"""Optimizer state keyed by parameter name, derived from any torch optimizer over the tensors a source holds.

Saving, each parameter of the local optimizer is found among the held tensors by identity; a state tensor with
the parameter's numel shares its spans (``optim/<fqn>/<name>``), a one-element state tensor of another shape (Adam's
``step``) is stored once per name (by the holder of the name's first element, replica 0), and non-tensor values and
the groups' settings go into the JSON side file. Loading builds the target optimizer's ``state_dict()``: state
buffers shaped like the local parameter, filled through its spans (padding zero), and each group's settings from
its parameters' names, refused if one group would get two different saved settings. Where the optimizer already
holds a per-element state tensor of the same size, dtype and layout (resuming after training steps), that tensor is
the buffer read into, so a load never holds the optimizer state twice.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardkit.checkpoint.errors import CheckpointError, IncompatibleCheckpointError
from shardkit.checkpoint.universal.placement import OPTIM_PREFIX, Placement, optim_key, replica_share
from shardkit.checkpoint.universal.side import SideState, decode, encode
from shardkit.checkpoint.universal.source import Held, UniversalSource


def spanned_placements(key_of: Callable[[str], str], held: Held, local: torch.Tensor) -> list[Placement]:
    """What this replica writes of ``local`` (a tensor laid out like ``held.tensor``): its share of every span."""
    out = []
    for span in held.spans:
        lo, hi = replica_share(span.numel, held.replica_rank, held.replica_count)
        if hi > lo or (span.numel == 0 and held.replica_rank == 0):
            out.append(
                Placement(
                    key_of(span.fqn),
                    span.shape,
                    local.dtype,
                    span.start + lo,
                    span.start + hi,
                    local,
                    span.local_offset + lo,
                    span.split,
                )
            )
    return out


def _optim_key_of(name: str, fqn: str) -> str:
    return optim_key(fqn, name)


def _is_spanned(value: torch.Tensor, param: torch.Tensor) -> bool:
    return value.numel() == param.numel() and not (value.dim() == 0 and param.dim() != 0)


def _holder(by_id: dict[int, Held], param: torch.Tensor, where: str) -> Held:
    held = by_id.get(id(param))
    if held is None:
        raise CheckpointError(
            f"{where} holds a parameter (shape {tuple(param.shape)}) that the checkpoint source does not report as "
            "held; the optimizer must be built over the wrapped model's parameters"
        )
    return held


def _group_names(source: UniversalSource, optimizer: torch.optim.Optimizer, by_id: dict[int, Held]) -> list[list[str]]:
    given = source.group_fqns()
    if given is not None:
        if len(given) != len(optimizer.param_groups):
            raise CheckpointError(
                f"the {source.strategy} source names {len(given)} param groups, its optimizer has "
                f"{len(optimizer.param_groups)}"
            )
        return [list(names) for names in given]
    return [
        [span.fqn for p in group["params"] for span in _holder(by_id, p, "the optimizer").spans]
        for group in optimizer.param_groups
    ]


def optimizer_placements(
    source: UniversalSource, held: list[Held], optimizer: torch.optim.Optimizer
) -> tuple[list[Placement], SideState]:
    """The optimizer-state placements this rank writes, and its side file."""
    by_id = {id(h.tensor): h for h in held}
    replicas = source.optimizer_replicas()
    if replicas is not None:
        by_id = {
            i: dataclasses.replace(h, replica_rank=replicas[0], replica_count=replicas[1]) for i, h in by_id.items()
        }
    side = SideState()
    placements: list[Placement] = []
    groups = source.group_settings() or optimizer.param_groups
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the {source.strategy} source gives settings for {len(groups)} param groups, its "
            f"optimizer has {len(optimizer.param_groups)}"
        )
    names_per_group = _group_names(source, optimizer, by_id)
    for gi, (group, names) in enumerate(zip(optimizer.param_groups, names_per_group)):
        settings = {k: encode(v, f"'{k}' of param group {gi}") for k, v in groups[gi].items() if k != "params"}
        for fqn in names:
            side.groups[fqn] = settings
        for param in group["params"]:
            holder = _holder(by_id, param, "the optimizer")
            if param not in optimizer.state:
                continue
            for name, value in optimizer.state[param].items():
                if not isinstance(value, torch.Tensor):
                    for span in holder.spans:
                        side.state.setdefault(span.fqn, {})[name] = encode(value, f"'{name}' of '{span.fqn}'")
                elif _is_spanned(value, param):
                    placements += spanned_placements(functools.partial(_optim_key_of, name), holder, value)
                elif value.numel() == 1:
                    placements += [
                        Placement(optim_key(span.fqn, name), value.shape, value.dtype, 0, 1, value)
                        for span in holder.spans
                        if span.start == 0 and holder.replica_rank == 0
                    ]
                else:
                    fqns = ", ".join(s.fqn for s in holder.spans)
                    raise CheckpointError(
                        f"optimizer state '{name}' of {fqns} has shape {tuple(value.shape)}, neither the parameter's "
                        f"{param.numel()} elements nor one value; the universal layout stores per-element or scalar "
                        "state only"
                    )
    return placements, side


def saved_optimizer_names(metadata: Metadata) -> dict[str, dict[str, TensorStorageMetadata]]:
    """Per parameter name, its saved optimizer state tensors by state name."""
    out: dict[str, dict[str, TensorStorageMetadata]] = defaultdict(dict)
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(OPTIM_PREFIX) and isinstance(entry, TensorStorageMetadata):
            fqn, _, name = key[len(OPTIM_PREFIX) :].rpartition("/")
            out[fqn][name] = entry
    return out


@dataclass
class OptimizerLoadPlan:
    """The buffers to fill (as placements) and how to build the state dict once they are filled."""

    placements: list[Placement] = field(default_factory=list)
    #: Live optimizer state tensors (flat) read into in place, with the flat ranges no span covers (padding).
    reused: list[tuple[torch.Tensor, list[tuple[int, int]]]] = field(default_factory=list)
    #: layout key -> how to name it in an error.
    what: dict[str, str] = field(default_factory=dict)
    state: dict[int, dict[str, Any]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)

    def prepare(self) -> None:
        """Zero the padding of the live buffers about to be read into (a fresh buffer's padding is zero too).

        Part of the load's fetch: it changes the optimizer, so it runs only once the load was validated."""
        with torch.no_grad():
            for flat, gaps in self.reused:
                for lo, hi in gaps:
                    flat[lo:hi].zero_()

    def state_dict(self) -> dict[str, Any]:
        """The ``torch.optim`` state dict for the local optimizer (valid after the placements were filled)."""
        return {"state": self.state, "param_groups": self.param_groups}


def plan_optimizer_load(
    source: UniversalSource,
    held: list[Held],
    optimizer: torch.optim.Optimizer,
    metadata: Metadata,
    side: SideState,
    stored: Callable[[str], str],
) -> OptimizerLoadPlan:
    """Check the checkpoint's optimizer state fits ``optimizer`` and plan reading it; nothing is changed.

    ``stored`` maps a held parameter name to the name the checkpoint stores it under (ties resolved)."""
    by_id = {id(h.tensor): h for h in held}
    saved = saved_optimizer_names(metadata)
    plan = OptimizerLoadPlan()
    index = 0
    for gi, (group, names) in enumerate(zip(optimizer.param_groups, _group_names(source, optimizer, by_id))):
        indices = []
        for param in group["params"]:
            holder = _holder(by_id, param, "the optimizer")
            state = _plan_param(plan, holder, param, saved, side, stored, optimizer.state.get(param, {}))
            if state:
                plan.state[index] = state
            indices.append(index)
            index += 1
        plan.param_groups.append({**_group_settings(gi, group, [stored(n) for n in names], side), "params": indices})
    return plan


def _plan_param(
    plan: OptimizerLoadPlan,
    holder: Held,
    param: torch.Tensor,
    saved: dict[str, dict[str, TensorStorageMetadata]],
    side: SideState,
    stored: Callable[[str], str],
    current: Any,
) -> dict[str, Any]:
    fqns = [stored(span.fqn) for span in holder.spans]
    kinds = {f: (frozenset(saved.get(f, {})), frozenset(side.state.get(f, {}))) for f in fqns}
    if len(set(kinds.values())) > 1:
        detail = "; ".join(f"'{f}': {sorted(t | s)}" for f, (t, s) in kinds.items())
        raise IncompatibleCheckpointError(
            f"parameters held in one tensor here have different optimizer state in the checkpoint ({detail}); "
            "it was saved before all of them were updated. Load without the optimizer or save after a full step."
        )
    if not fqns:
        return {}
    tensor_names, other_names = kinds[fqns[0]]
    state: dict[str, Any] = {}
    for name in sorted(tensor_names):
        entry = saved[fqns[0]][name]
        if _is_full_shaped(holder, fqns, saved, name):
            buffer = _reusable(current.get(name), param, entry.properties.dtype, plan)
            if buffer is None:
                buffer = torch.zeros(param.numel(), dtype=entry.properties.dtype)
            else:
                plan.reused.append((buffer, _gaps(param.numel(), holder)))
            for span, fqn in zip(holder.spans, fqns):
                key = optim_key(fqn, name)
                plan.placements.append(
                    Placement(
                        key, span.shape, buffer.dtype, span.start, span.stop, buffer, span.local_offset, span.split
                    )
                )
                plan.what[key] = f"optimizer state '{name}' of parameter '{span.fqn}'"
            state[name] = buffer.view(param.shape)
        elif math.prod(entry.size) == 1:
            buffer = torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
            key = optim_key(fqns[0], name)
            plan.placements.append(Placement(key, torch.Size(entry.size), buffer.dtype, 0, 1, buffer))
            plan.what[key] = f"optimizer state '{name}' of parameter '{holder.spans[0].fqn}'"
            state[name] = buffer
        else:
            raise IncompatibleCheckpointError(
                f"optimizer state '{name}' of '{fqns[0]}' has shape {tuple(entry.size)} in the checkpoint, but the "
                f"parameter here has shape {tuple(holder.spans[0].shape)}; load it into the model that saved it"
            )
    for name in sorted(other_names):
        state[name] = decode(side.state[fqns[0]][name])
    return state


def _reusable(value: Any, param: torch.Tensor, dtype: torch.dtype, plan: OptimizerLoadPlan) -> Optional[torch.Tensor]:
    """``value`` (the optimizer's current state tensor) as a flat buffer to read into, or None for a fresh one.

    Only a contiguous tensor of the parameter's size, device and the saved dtype that no other buffer of this load
    shares memory with: anything else gets a fresh buffer, as before."""
    if not isinstance(value, torch.Tensor) or value.numel() != param.numel() or value.numel() == 0:
        return None
    if value.dtype != dtype or value.device != param.device or not value.is_contiguous():
        return None
    pointer = value.untyped_storage().data_ptr()
    if any(flat.untyped_storage().data_ptr() == pointer for flat, _ in plan.reused):
        return None
    return value.detach().view(-1)


def _gaps(numel: int, holder: Held) -> list[tuple[int, int]]:
    """The flat ranges of a held tensor of ``numel`` elements that none of its spans covers."""
    gaps, at = [], 0
    for lo, hi in sorted((s.local_offset, s.local_offset + s.numel) for s in holder.spans):
        if lo > at:
            gaps.append((at, lo))
        at = max(at, hi)
    if at < numel:
        gaps.append((at, numel))
    return gaps


def _is_full_shaped(
    holder: Held,
    fqns: list[str],
    saved: dict[str, dict[str, TensorStorageMetadata]],
    name: str,
) -> bool:
    """Whether state ``name`` is per element: saved with each held parameter's own full shape."""
    return all(tuple(saved[f][name].size) == tuple(span.shape) for f, span in zip(fqns, holder.spans))


def _group_settings(gi: int, group: dict[str, Any], names: list[str], side: SideState) -> dict[str, Any]:
    """The saved settings of a target param group, found by its parameters' names; its own when it has none."""
    mine = {k: v for k, v in group.items() if k != "params"}
    if not names:
        return mine
    missing = [n for n in names if n not in side.groups]
    if missing:
        raise IncompatibleCheckpointError(
            f"the checkpoint holds no optimizer settings for parameter '{missing[0]}' (param group {gi}); it was "
            "saved from another model or without this parameter in the optimizer"
        )
    first = side.groups[names[0]]
    for name in names[1:]:
        if side.groups[name] != first:
            raise IncompatibleCheckpointError(
                f"param group {gi} here holds '{names[0]}' and '{name}', which the checkpoint saved with different "
                f"settings ({_diff(first, side.groups[name])}); build the optimizer's param groups as they were saved"
            )
    if set(first) != set(mine):
        extra, lacking = sorted(set(first) - set(mine)), sorted(set(mine) - set(first))
        raise IncompatibleCheckpointError(
            f"param group {gi}: the checkpoint's optimizer settings do not fit this optimizer (only in the "
            f"checkpoint: {extra}; only here: {lacking}); load it into the optimizer class that saved it"
        )
    return {k: decode(v) for k, v in first.items()}


def _diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys[:3])
