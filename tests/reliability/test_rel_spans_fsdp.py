"""The FSDP source's span arithmetic against real flat shards: every element of every parameter is held by
exactly one rank of a group, at the offset the piece names, for every world size (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.checkpoint.adapters.fsdp import unit_replicas
from shardkit.nn.fsdp.flat_param import ParamLocation, build_meta
from shardkit.nn.fsdp.shard_layout import (
    flat_param_aliases,
    flat_param_pieces,
    join_name,
)


def _owners() -> tuple[list[tuple[ParamLocation, nn.Parameter]], list[tuple[ParamLocation, int]]]:
    torch.manual_seed(0)
    host = nn.Module()
    shapes = {"fc1.weight": (5, 3), "fc1.bias": (5,), "scale": (), "fc2.weight": (2, 3, 4)}
    owners = []
    for name, shape in shapes.items():
        path, _, attr = name.rpartition(".")
        owners.append((ParamLocation(path, attr, host), nn.Parameter(torch.randn(shape))))
    aliases = [(ParamLocation("head", "weight", host), 0)]  # head.weight is tied to fc1.weight
    return owners, aliases


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 40])
def test_pieces_cover_every_element_once_and_point_at_the_shard(world_size: int) -> None:
    owners, aliases = _owners()
    rebuilt = {
        join_name("blk", join_name(loc.module_path, loc.attr)): torch.full((p.numel(),), float("nan"))
        for loc, p in owners
    }
    for rank in range(world_size):
        meta = build_meta(owners, aliases, world_size, rank)
        shard = meta.local_shard(meta.flatten([p for _, p in owners], torch.device("cpu"))).clone()
        for piece in flat_param_pieces("blk", meta):
            target = rebuilt[piece.fqn]
            assert target.numel() == torch.Size(piece.shape).numel()
            assert torch.isnan(target[piece.start : piece.stop]).all(), f"{piece.fqn} written twice"
            target[piece.start : piece.stop] = shard[piece.local_offset : piece.local_offset + piece.stop - piece.start]
    for (_loc, param), (name, values) in zip(owners, rebuilt.items()):
        assert torch.equal(values, param.detach().reshape(-1)), name


def test_names_carry_the_unit_prefix_and_aliases_point_at_the_stored_name() -> None:
    owners, aliases = _owners()
    meta = build_meta(owners, aliases, 1, 0)
    assert [p.fqn for p in flat_param_pieces("", meta)] == ["fc1.weight", "fc1.bias", "scale", "fc2.weight"]
    assert next(p.fqn for p in flat_param_pieces("layers.3", meta)) == "layers.3.fc1.weight"
    assert flat_param_aliases("layers.3", meta) == {"layers.3.head.weight": "layers.3.fc1.weight"}
    assert flat_param_aliases("", meta) == {"head.weight": "fc1.weight"}


def test_a_rank_holding_only_padding_gets_no_piece() -> None:
    owners, aliases = _owners()
    total = sum(p.numel() for _, p in owners)  # 15 + 5 + 1 + 24 = 45 elements
    meta = build_meta(owners, aliases, 64, 63)  # chunks of one element; rank 63 holds padding
    assert total < 64 and flat_param_pieces("", meta) == []


def test_replicas_of_hybrid_units_and_units_over_part_of_the_job() -> None:
    assert unit_replicas("", 4, 0, 1, 4) == (0, 1)
    assert unit_replicas("blocks.0", 2, 1, 2, 4) == (1, 2)  # hybrid: two nodes of two
    assert unit_replicas("", 1, 3, 4, 4) == (3, 4)  # NO_SHARD: every rank a replica
    with pytest.raises(ValueError, match=r"'experts\.1' is sharded over 1 ranks with 1 replica"):
        unit_replicas("experts.1", 1, 0, 1, 4)  # per-rank units: their values may differ
