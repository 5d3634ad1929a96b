"""Sharded state dicts for torch.distributed.checkpoint: one row-sharded DTensor per original parameter."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from shardkit.distributed.groups import GroupLike, is_dummy, torch_group
from shardkit.nn._torch_private import IncompatibleKeys
from shardkit.nn.fsdp.shard_layout import FlatLayout, ShardLayout, UnitLayout, layout, reshard
from shardkit.nn.fsdp.state_dict._io import (
    agree,
    gathered_params,
    load_buffers,
    validation_error,
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


def _check_one_sharding_group(fsdp: UnitModule, view: ShardLayout) -> None:
    odd = sorted(unit.path or "<root>" for unit in view.units if unit.world_size != fsdp.world_size)
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

    view = layout(fsdp).require_idle("sharded_state_dict()")
    _check_one_sharding_group(fsdp, view)
    meshes: dict[int, Any] = {}

    def as_dtensor(unit: UnitLayout, _: FlatLayout, piece: torch.Tensor) -> Any:
        if is_dummy(unit.process_group):
            return piece.clone()
        placement = Shard(0) if piece.dim() > 0 else Replicate()
        local = _row_chunk(piece, unit.rank, unit.world_size) if piece.dim() > 0 else piece
        mesh = _mesh(unit.process_group, piece.device, meshes)
        return DTensor.from_local(
            local.clone(), mesh, [placement], run_check=False, shape=piece.shape, stride=piece.stride()
        )

    out: dict[str, Any] = OrderedDict(gathered_params(view, "sharded_state_dict", as_dtensor))
    for b in view.buffers:
        out[b.key] = b.value().clone()
    return out


def load_sharded_state_dict(fsdp: UnitModule, sharded: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
    """Load a dict shaped like :func:`sharded_state_dict` (filled by ``dcp.load``, any saving world size).

    Plain full tensors are accepted in place of DTensors. Validation and the all-or-nothing guarantee are those of
    :func:`load_state_dict`. Cost: one all-gather per parameter (``DTensor.full_tensor``), peak one parameter.
    """
    view = layout(fsdp).require_idle("load_sharded_state_dict()")
    error, missing, unexpected = validation_error("load_sharded_state_dict", view.expected_shapes(), sharded, strict)
    agree(fsdp, view, error)
    reshard(fsdp)
    for e in view.params:  # same order on every rank: full_tensor() is a collective
        if e.alias or e.key not in sharded:
            continue
        value = sharded[e.key]
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        write_shards([e], {e.key: full})
    load_buffers(view, sharded)
    return IncompatibleKeys(missing, unexpected)
