"""Walking a wrapped model in the unwrapped model's names, and the validate-then-write helpers every loader uses.

A name is resolved through the core's flat-parameter layout (:class:`~shardkit.nn.fsdp.flat_param.FlatParamMeta`
and each handle's ``locations``): parameter ``i`` of a flat parameter lives at ``getattr(*handle.locations[i])``
while gathered and at ``meta.params[i].offset`` in the unpadded flat buffer; wrappers add no path segment.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed import collectives as c
from shardkit.distributed.groups import GroupLike, is_dummy
from shardkit.nn.fsdp.handle import FlatParamHandle
from shardkit.nn.fsdp.runtime import TrainingState
from shardkit.nn.fsdp.unit_module import UnitModule, walk_modules


@dataclass(frozen=True)
class ParamEntry:
    """One original parameter name: where its values live (``handle.meta.params[index]``)."""

    key: str
    handle: FlatParamHandle
    group: GroupLike
    index: int
    alias: bool


@dataclass(frozen=True)
class BufferEntry:
    key: str
    module: nn.Module
    attr: str


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def walk(module: nn.Module, path: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Pre-order modules with unwrapped names; like ``nn.Module.state_dict`` a shared module appears once per path."""
    for clean, _, m in walk_modules(module, path, once=False):
        yield clean, m


def units(fsdp: UnitModule) -> list[UnitModule]:
    seen: dict[int, UnitModule] = {}
    for _, m in walk(fsdp):
        if isinstance(m, UnitModule):
            seen.setdefault(id(m), m)
    return list(seen.values())


def layout(fsdp: UnitModule) -> tuple[list[ParamEntry], list[BufferEntry], dict[str, dict[str, int]]]:
    """Parameter and persistent-buffer entries in ``state_dict`` order, and each module's version metadata."""
    located: dict[int, list[tuple[str, FlatParamHandle, GroupLike, int, bool]]] = {}
    for unit in units(fsdp):
        for h in unit.fsdp_unit.group.handles:
            for i, (module, attr) in enumerate(h.locations):
                located.setdefault(id(module), []).append((attr, h, unit.process_group, i, False))
            for (module, attr), info in zip(h.alias_locations, h.meta.shared):
                located.setdefault(id(module), []).append((attr, h, unit.process_group, info.primary, True))
    params: list[ParamEntry] = []
    buffers: list[BufferEntry] = []
    versions: dict[str, dict[str, int]] = {}
    for path, module in walk(fsdp):
        if isinstance(module, UnitModule):
            continue
        versions[path] = {"version": getattr(module, "_version", 1)}
        for attr, h, group, i, alias in located.get(id(module), []):
            params.append(ParamEntry(join(path, attr), h, group, i, alias))
        for attr, buf in module._buffers.items():
            if buf is not None and attr not in module._non_persistent_buffers_set:
                buffers.append(BufferEntry(join(path, attr), module, attr))
    return params, buffers, versions


def check_idle(fsdp: UnitModule, what: str) -> None:
    for unit in units(fsdp):
        if unit.training_state != TrainingState.IDLE:
            raise RuntimeError(
                f"{what} was called while unit '{unit.fsdp_unit.name}' is in state {unit.training_state.name}; call it "
                "between training steps, outside forward, backward and summon_full_params()"
            )


def buffer_dtypes(fsdp: UnitModule) -> dict[str, torch.dtype]:
    """Original dtypes of buffers that mixed precision cast, keyed relative to ``fsdp``."""
    root_unit = fsdp.fsdp_unit.root
    if root_unit is None:
        return dict(fsdp.buffer_original_dtypes)
    root = root_unit.group.owner
    assert isinstance(root, UnitModule)
    prefix = next((p for p, m in walk(root) if m is fsdp), "")
    cut = len(prefix) + 1 if prefix else 0
    return {k[cut:]: v for k, v in root.buffer_original_dtypes.items() if not prefix or k.startswith(prefix + ".")}


def buffer_value(entry: BufferEntry, dtypes: Mapping[str, torch.dtype], device: Optional[torch.device]) -> Any:
    buf = entry.module._buffers[entry.attr]
    assert buf is not None
    return buf.detach().to(device=device or buf.device, dtype=dtypes.get(entry.key, buf.dtype))


# ---------------------------------------------------------------------------------------------- communication
def gather_flat(handle: FlatParamHandle, group: GroupLike, shard: torch.Tensor, label: str) -> torch.Tensor:
    """All-gather a shard-shaped tensor of ``handle`` into the padded full flat buffer (on the compute device)."""
    full = torch.empty(handle.meta.padded_numel, dtype=shard.dtype, device=handle.compute_device)
    c.all_gather_into_tensor(full, shard.detach().to(full.device), group=group, label=f"fsdp:{label}:{handle.label}")
    return full


def agree(fsdp: UnitModule, error: Optional[str]) -> None:
    """Raise on every rank of ``fsdp``'s group if any rank found ``error``, before anything is written."""
    group = fsdp.process_group
    if not is_dummy(group) and fsdp.world_size > 1:
        # The flag must live where the group's backend communicates (CUDA for NCCL): any unit's compute device.
        devices = [h.compute_device for unit in units(fsdp) for h in unit.fsdp_unit.group.handles]
        flag = torch.tensor([1.0 if error else 0.0], device=devices[0] if devices else "cpu")
        c.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, label="fsdp:state_dict:validate")
        if flag.item() > 0 and not error:
            error = "another rank rejected its state dict (see its error); nothing was loaded"
    if error:
        raise ValueError(error)


def expected_shapes(params: list[ParamEntry], buffers: list[BufferEntry]) -> dict[str, torch.Size]:
    """The shape every key of a full state dict must have."""
    shapes = {e.key: e.handle.meta.params[e.index].shape for e in params}
    for b in buffers:
        buf = b.module._buffers[b.attr]
        assert buf is not None
        shapes[b.key] = buf.shape
    return shapes


def validation_error(
    what: str, expected: Mapping[str, torch.Size], given: Mapping[str, Any], strict: bool
) -> tuple[Optional[str], list[str], list[str]]:
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


def write_shards(entries: list[ParamEntry], value_of: Mapping[str, torch.Tensor]) -> None:
    """Copy each given parameter's part of this rank's shard (no communication: values are full on every rank)."""
    by_handle: dict[int, tuple[FlatParamHandle, dict[int, torch.Tensor]]] = {}
    for e in entries:
        if e.key in value_of:
            by_handle.setdefault(id(e.handle), (e.handle, {}))[1][e.index] = value_of[e.key]
    with torch.no_grad():
        for handle, values in by_handle.values():
            shard = handle.shard
            for s in handle.meta.shard_slices():
                if s.param_index in values:
                    piece = values[s.param_index].reshape(-1)[s.param_start : s.param_end]
                    shard[s.shard_start : s.shard_start + len(piece)].copy_(piece)


def reshard_all(fsdp: UnitModule) -> None:
    # Full copies kept from a forward without backward would be stale after a load.
    for unit in units(fsdp):
        unit.fsdp_unit.group.reshard()


def flat_entries(fsdp: UnitModule) -> list[tuple[str, FlatParamHandle, UnitModule]]:
    out: list[tuple[str, FlatParamHandle, UnitModule]] = []
    seen: set[int] = set()
    for path, unit in walk(fsdp):
        if not isinstance(unit, UnitModule) or id(unit) in seen:
            continue
        seen.add(id(unit))
        out.extend((join(path, h.name), h, unit) for h in unit.fsdp_unit.group.handles)
    return out
