"""The read model of a wrapped model's shards: ``shardkit.nn.fsdp.layout(model)`` names every original parameter
as the unwrapped model does, says which slice of it every rank holds (checked against the real shards), is frozen,
and is the only way the readers reach FSDP's run-time objects (checked over the source)."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import shardkit
from shardkit.distributed import DummyProcessGroup
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import TrainingState, layout
from shardkit.testing import run_distributed

SRC = Path(shardkit.__file__).resolve().parent


class _Tied(nn.Module):
    """An embedding tied to its head, a nested block and a BatchNorm (a persistent buffer) at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3)
        self.block = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 3))
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 7, bias=False)
        self.head.weight = self.embed.weight


def _wrap(group: DummyProcessGroup) -> tuple[nn.Module, FSDP]:
    torch.manual_seed(0)
    plain = _Tied()
    model = copy.deepcopy(plain)
    model.block = FSDP(model.block, process_group=group)
    return plain, FSDP(model, process_group=group)


def test_names_shapes_and_order_are_the_unwrapped_models() -> None:
    plain, model = _wrap(DummyProcessGroup(rank=0, size=1))
    view = layout(model)
    assert [u.path for u in view.units] == ["", "block"]
    assert {p.key: p.shape for p in view.params} == {
        k: p.shape for k, p in plain.state_dict(keep_vars=True).items() if isinstance(p, nn.Parameter)
    }
    assert [b.key for b in view.buffers] == [k for k, _ in plain.named_buffers()]
    assert view.state_dict_keys() == list(plain.state_dict()) == list(model.state_dict())
    aliases = [p for p in view.params if p.alias]
    assert [p.key for p in aliases] == ["head.weight"] and view.flats[0].aliases() == {"head.weight": "embed.weight"}
    block = view.units[1].flats[0]
    assert block.key == "block.flat_param_0" and block.fqns[0] == "block.0.weight"
    assert view.busy_unit() is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.units[0].path = "x"  # type: ignore[misc]
    with pytest.raises(TypeError, match="FullyShardedDataParallel"):
        layout(plain)


def test_pieces_of_every_rank_cover_each_parameter_once_and_this_ranks_match_its_shard() -> None:
    plain, model = _wrap(DummyProcessGroup(rank=1, size=3))
    want = {k: v.detach().reshape(-1) for k, v in plain.state_dict().items()}
    for flat in layout(model).flats:
        assert flat.meta.padded_numel == flat.meta.numel + flat.padding and flat.padding < 3
        covered = {fqn: torch.zeros(want[fqn].numel(), dtype=torch.int64) for fqn in flat.fqns}
        for rank in range(3):
            for piece in flat.pieces(rank):
                covered[piece.fqn][piece.start : piece.stop] += 1
        assert all(bool((c == 1).all()) for c in covered.values()), f"{flat.key}: {covered}"
        assert flat.pieces() == flat.pieces(1)
        for piece in flat.pieces():
            held = flat.shard.detach()[piece.local_offset : piece.local_offset + piece.stop - piece.start]
            assert torch.equal(held, want[piece.fqn][piece.start : piece.stop]), piece
        with pytest.raises(ValueError, match="outside the unit's group of 3"):
            flat.pieces(3)


def test_the_view_reports_a_unit_inside_summon_and_readers_refuse() -> None:
    _, model = _wrap(DummyProcessGroup(rank=0, size=1))
    with model.summon_full_params():
        busy = layout(model).busy_unit()
        assert busy is not None and busy.state is TrainingState.SUMMON_FULL_PARAMS
        with pytest.raises(RuntimeError, match="between training steps"):
            model.local_state_dict()
    assert layout(model).busy_unit() is None


def _ranks_agree(rank: int, world_size: int) -> list[list[tuple[str, int, int]]]:
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)))
    flat = layout(model).flats[0]
    return [[(p.fqn, p.start, p.stop) for p in flat.pieces(r)] for r in range(world_size)]


def test_every_rank_computes_the_same_map_of_who_holds_what() -> None:
    maps = run_distributed(_ranks_agree, 2, timeout_s=120)
    assert maps[0] == maps[1]
    assert maps[0][0] and maps[0][1] and maps[0][0] != maps[0][1]


# The run-time objects of a unit: only nn/fsdp's core reads them; every reader goes through shard_layout.
_CORE = {"api.py", "grad_norm.py", "hf_models.py", "param_group.py", "runtime.py", "shard_layout.py", "unit_module.py"}
_READERS = ("nn/fsdp/state_dict", "checkpoint", "lightning")


def _handles_reads(tree: ast.AST) -> list[int]:
    """Lines reading ``<...>.group.handles`` / ``group.handles`` / ``param_group.handles``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "handles":
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("group", "param_group"):
                lines.append(node.lineno)
    return lines


def test_no_module_outside_the_fsdp_core_touches_group_handles() -> None:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        lines = _handles_reads(ast.parse(path.read_text(), rel))
        if lines and not (rel.startswith("nn/fsdp/") and rel.count("/") == 2 and path.name in _CORE):
            found[rel] = lines
    assert found == {}, f"read FSDP through shardkit.nn.fsdp.layout(), not group.handles: {found}"


def test_readers_reach_fsdp_through_the_read_model_only() -> None:
    banned = {"fsdp_unit", "handles", "flat_param_metas", "flat_params", "_unit"}
    found = {}
    for reader in _READERS:
        for path in sorted((SRC / reader).rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
            # ``Adapter.handles(model, optimizer)`` is the adapters' own classmethod, not FSDP's handles.
            hits = sorted(names & banned - ({"handles"} if "checkpoint" in reader else set()))
            if hits:
                found[path.relative_to(SRC).as_posix()] = hits
    assert found == {}, f"read FSDP through shardkit.nn.fsdp.layout(): {found}"
