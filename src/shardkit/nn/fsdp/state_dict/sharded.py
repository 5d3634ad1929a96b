"""Sharded state dicts for torch.distributed.checkpoint: one row-sharded DTensor per original parameter."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from shardkit.distributed.groups import GroupLike, is_dummy, torch_group
from shardkit.nn._torch_private import IncompatibleKeys
from shardkit.nn.fsdp.state_dict._layout import (
    agree,
    buffer_dtypes,
    buffer_value,
    check_idle,
    expected_shapes,
    gather_flat,
    layout,
    reshard_all,
    units,
    validation_error,
    walk,
    write_shards,
)
from shardkit.nn.fsdp.unit_module import UnitModule


def _row_chunk(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's block of rows in DTensor ``Shard(0)`` layout: ``torch.chunk`` sizes, trailing ranks possibly empty."""
    rows = full.shape[0]
    step = -(-rows // world_size)
    start = min(rank * step, rows)
    return full[start : min(start + step, rows)]


def _mesh(group: GroupLike, device: torch.device, cache: dict[int, Any]) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if id(group) not in cache:
        cache[id(group)] = DeviceMesh.from_group(torch_group(group, "sharded_state_dict"), device.type)
    return cache[id(group)]


def _check_one_sharding_group(fsdp: UnitModule) -> None:
    sizes = {path or "<root>": m.world_size for path, m in walk(fsdp) if isinstance(m, UnitModule)}
    odd = sorted(path for path, size in sizes.items() if size != fsdp.world_size)
    if odd:
        raise NotImplementedError(
            f"sharded_state_dict: units {odd} are sharded over a group of another size than the root's "
            f"{fsdp.world_size} ranks; their values may differ per group (e.g. per-rank experts), which one DCP key "
            "cannot hold. Save such models with state_dict() or local_state_dict()."
        )


def sharded_state_dict(fsdp: UnitModule) -> dict[str, Any]:
    """Per original parameter a ``DTensor`` (``Shard(0)`` over the unit's group) for torch.distributed.checkpoint.

    Keys are the unwrapped model's; buffers are plain tensors (DCP saves them once). Save with
    ``dcp.save(sharded_state_dict(model), checkpoint_id=...)``; to load, at any world size, pass a fresh
    ``sharded_state_dict(model)`` to ``dcp.load`` and then to :func:`load_sharded_state_dict`. Cost: one
    all-gather per flat parameter; the result holds ``1/world_size`` of every parameter, peak one full flat
    parameter more. Units over a size-one :class:`DummyProcessGroup` give plain full tensors.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    check_idle(fsdp, "sharded_state_dict()")
    _check_one_sharding_group(fsdp)
    params, buffers, _ = layout(fsdp)
    meshes: dict[int, Any] = {}
    values: dict[tuple[int, int], Any] = {}
    for unit in units(fsdp):
        group = unit.process_group
        for h in unit.fsdp_unit.group.handles:
            full = gather_flat(h, group, h.shard, "sharded_state_dict")
            for i, info in enumerate(h.meta.params):
                piece = full[info.offset : info.offset + info.numel].view(info.shape)
                if is_dummy(group):
                    values[(id(h), i)] = piece.clone()
                    continue
                placement = Shard(0) if piece.dim() > 0 else Replicate()
                local = _row_chunk(piece, unit.rank, unit.world_size) if piece.dim() > 0 else piece
                values[(id(h), i)] = DTensor.from_local(
                    local.clone(),
                    _mesh(group, full.device, meshes),
                    [placement],
                    run_check=False,
                    shape=piece.shape,
                    stride=piece.stride(),
                )
    out: dict[str, Any] = OrderedDict((e.key, values[(id(e.handle), e.index)]) for e in params)
    dtypes = buffer_dtypes(fsdp)
    for b in buffers:
        out[b.key] = buffer_value(b, dtypes, None).clone()
    return out


def load_sharded_state_dict(fsdp: UnitModule, sharded: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
    """Load a dict shaped like :func:`sharded_state_dict` (filled by ``dcp.load``, any saving world size).

    Plain full tensors are accepted in place of DTensors. Validation and the all-or-nothing guarantee are those of
    :func:`load_state_dict`. Cost: one all-gather per parameter (``DTensor.full_tensor``), peak one parameter.
    """
    check_idle(fsdp, "load_sharded_state_dict()")
    params, buffers, _ = layout(fsdp)
    expected = expected_shapes(params, buffers)
    error, missing, unexpected = validation_error("load_sharded_state_dict", expected, sharded, strict)
    agree(fsdp, error)
    reshard_all(fsdp)
    for e in params:  # same order on every rank: full_tensor() is a collective
        if e.alias or e.key not in sharded:
            continue
        value = sharded[e.key]
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        write_shards([e], {e.key: full})
    with torch.no_grad():
        for b in buffers:
            if b.key in sharded:
                b.module._buffers[b.attr].copy_(sharded[b.key])  # type: ignore[union-attr]
    return IncompatibleKeys(missing, unexpected)
