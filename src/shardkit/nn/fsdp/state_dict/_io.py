"""What every state-dict function shares, on top of the read model (:mod:`shardkit.nn.fsdp.shard_layout`): the
one gather, and the validate-then-write helpers every loader uses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from shardkit.distributed import collectives as c
from shardkit.distributed.groups import is_dummy
from shardkit.nn.fsdp.shard_layout import FlatLayout, ParamName, ShardLayout, UnitLayout
from shardkit.nn.fsdp.unit_module import UnitModule


def gather_flat(flat: FlatLayout, shard: torch.Tensor, label: str) -> torch.Tensor:
    """All-gather a shard-shaped tensor of ``flat`` into the padded full flat buffer (on the compute device)."""
    full = torch.empty(flat.meta.padded_numel, dtype=shard.dtype, device=flat.compute_device)
    group = flat.process_group
    c.all_gather_into_tensor(full, shard.detach().to(full.device), group=group, label=f"fsdp:{label}:{flat.label}")
    return full


def gathered_params(
    view: ShardLayout, label: str, keep: Callable[[UnitLayout, FlatLayout, torch.Tensor], Any]
) -> dict[str, Any]:
    """Every parameter name of ``view`` (``state_dict()`` order) -> ``keep(unit, flat, value)``, ``value`` a view of
    the gathered full flat buffer shaped like the parameter. Flat parameters are gathered unit by unit (the same
    order on every rank): one all-gather each, peak one full flat parameter."""
    kept: dict[tuple[int, int], Any] = {}
    for unit in view.units:
        for flat in unit.flats:
            for i, value in enumerate(flat.meta.views(gather_flat(flat, flat.shard, label))):
                kept[(id(flat.shard), i)] = keep(unit, flat, value)
    return {p.key: kept[(id(p.flat.shard), p.index)] for p in view.params}


def agree(fsdp: UnitModule, view: ShardLayout, error: Optional[str]) -> None:
    """Raise on every rank of ``fsdp``'s group if any rank found ``error``, before anything is written."""
    group = fsdp.process_group
    if not is_dummy(group) and fsdp.world_size > 1:
        # The flag must live where the group's backend communicates (CUDA for NCCL): any unit's compute device.
        devices = [flat.compute_device for flat in view.flats]
        flag = torch.tensor([1.0 if error else 0.0], device=devices[0] if devices else "cpu")
        c.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, label="fsdp:state_dict:validate")
        if flag.item() > 0 and not error:
            error = "another rank rejected its state dict (see its error); nothing was loaded"
    if error:
        raise ValueError(error)


def validation_error(
    what: str, expected: Mapping[str, torch.Size], given: Mapping[str, Any], strict: bool
) -> tuple[Optional[str], list[str], list[str]]:
    """The error message for ``given`` against the ``expected`` shapes (None if fine), the missing and the
    unexpected keys."""
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    problems = []
    if strict and missing:
        problems.append(f"missing keys {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for key, shape in expected.items():
        value = given.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or value.shape != shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            problems.append(f"'{key}' has shape {got}, the model needs {tuple(shape)}")
    if not problems:
        return None, missing, unexpected
    return f"{what}: {'; '.join(problems)}. Nothing was loaded.", missing, unexpected


def write_shards(names: list[ParamName], value_of: Mapping[str, torch.Tensor]) -> None:
    """Copy each given parameter's part of this rank's shard (no communication: values are full on every rank)."""
    by_flat: dict[int, tuple[FlatLayout, dict[int, torch.Tensor]]] = {}
    for e in names:
        if e.key in value_of:
            by_flat.setdefault(id(e.flat.shard), (e.flat, {}))[1][e.index] = value_of[e.key]
    with torch.no_grad():
        for flat, values in by_flat.values():
            for s in flat.meta.shard_slices():
                if s.param_index in values:
                    piece = values[s.param_index].reshape(-1)[s.param_start : s.param_end]
                    flat.shard[s.shard_start : s.shard_start + len(piece)].copy_(piece)


def load_buffers(view: ShardLayout, values: Mapping[str, Any]) -> None:
    """Copy every buffer ``values`` names into the model."""
    for b in view.buffers:
        if b.key in values:
            b.load(values[b.key])
