"""Checkpoint memory: what a save hands DCP and where a load reads into.

A save must give DCP each box as a tensor whose storage is the box alone (DCP clones anything else and keeps every
clone until the rank's file is closed: a second copy of all the rank writes). A load into an optimizer that already
has state (resuming) must read into those state tensors, not into fresh buffers next to them, with the padding of
flat shards zero as a fresh buffer's would be; OSS then adopts the tensors instead of copying them.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from any_to_any_lib import build, release, train
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem
from torch.utils._python_dispatch import TorchDispatchMode

from shardkit.checkpoint import load_checkpoint, safe_dcp, save_checkpoint
from shardkit.checkpoint.universal.placement import Placement
from shardkit.checkpoint.universal.plans import UniversalLoadPlanner, UniversalSavePlanner, exact_storage, pieces_for
from shardkit.testing import run_distributed


def test_exact_storage_aliases_the_view_with_a_storage_of_its_own_size() -> None:
    flat = torch.arange(40, dtype=torch.float32)
    for view in (flat[5:17].view(3, 4), flat[7:8].view(()), flat.to(torch.bfloat16)[3:9]):
        alias = exact_storage(view)
        assert alias.untyped_storage().nbytes() == view.nbytes
        assert alias.data_ptr() == view.data_ptr() and alias.dtype == view.dtype and alias.shape == view.shape
        assert torch.equal(alias, view)
    assert exact_storage(flat) is flat  # already exact
    strided = flat.view(8, 5)[:, :2]
    assert exact_storage(strided) is strided  # not contiguous: left to DCP


class _CountClones(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.cloned = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.clone.default:
            self.cloned += out.nbytes
        return out


class _ViewPlanner(UniversalSavePlanner):
    """The save planner handing DCP the raw views (what it did before)."""

    def resolve_data(self, write_item: WriteItem) -> Any:
        return self._pieces[(write_item.index.fqn, tuple(write_item.index.offset or ()))].tensor


def _save_counting(store: Path, planner: UniversalSavePlanner) -> int:
    with warnings.catch_warnings(), _CountClones() as counter:
        warnings.simplefilter("ignore")
        dcp.save({}, storage_writer=FileSystemWriter(store, thread_count=1), planner=planner, no_dist=True)
    return counter.cloned


def test_a_save_of_views_into_a_flat_shard_clones_nothing(tmp_path: Path) -> None:
    weight, bias = torch.randn(6, 5), torch.randn(6)
    shard = torch.cat([weight.reshape(-1)[7:], bias, torch.zeros(3)])  # an unaligned flat shard with padding
    placements = [
        Placement("model/w", weight.shape, weight.dtype, 7, 30, shard, 0),
        Placement("model/b", bias.shape, bias.dtype, 0, 6, shard, 23),
    ]
    assert _save_counting(tmp_path / "views", _ViewPlanner(pieces_for(placements))) > 0  # the check can fail
    assert _save_counting(tmp_path / "exact", UniversalSavePlanner(pieces_for(placements))) == 0
    into = torch.full((29,), -1.0)
    back = [
        Placement("model/w", weight.shape, weight.dtype, 7, 30, into, 0),
        Placement("model/b", bias.shape, bias.dtype, 0, 6, into, 23),
    ]
    safe_dcp.load_planned(tmp_path / "exact", UniversalLoadPlanner(pieces_for(back)))
    assert torch.equal(into[:23], weight.reshape(-1)[7:]) and torch.equal(into[23:], bias)


def _local_optimizer(run: Any) -> torch.optim.Optimizer:
    return run.optimizer.optim if run.family == "oss_sdp" else run.optimizer


def _state(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    return {
        id(p): {k: v for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        for p, s in optimizer.state.items()
    }


def _resume_in_place(rank: int, world_size: int, family: str, directory: str) -> dict[str, Any]:
    run = build(family, rank, world_size, seed=0)
    try:
        train(run, range(2))
        save_checkpoint(directory, step=2, model=run.model, optimizer=run.optimizer)
        saved = {i: {k: v.clone() for k, v in s.items()} for i, s in _state(_local_optimizer(run)).items()}
        train(run, range(2, 3))
        before = _state(_local_optimizer(run))
        for values in before.values():
            for value in values.values():
                value.fill_(7.0)  # padding too: the load must leave it zero, as a fresh buffer's
        load_checkpoint(directory, model=run.model, optimizer=run.optimizer)
        after = _state(_local_optimizer(run))
        return {
            "tensors": sum(len(v) for v in after.values()),
            "same_storage": all(after[i][k].data_ptr() == before[i][k].data_ptr() for i in before for k in before[i]),
            "equal": all(torch.equal(after[i][k], saved[i][k]) for i in saved for k in saved[i]),
            "same_keys": {i: set(v) for i, v in after.items()} == {i: set(v) for i, v in saved.items()},
        }
    finally:
        release(run)


def test_resuming_reads_optimizer_state_into_its_own_tensors(tmp_path: Path) -> None:
    for family in ("fsdp_nested", "oss_sdp"):
        results = run_distributed(_resume_in_place, 2, family, str(tmp_path / family))
        for rank, out in enumerate(results):
            assert out["tensors"] > 0, (family, rank)
            assert out["equal"] and out["same_keys"], (family, rank, out)
            assert out["same_storage"], (family, rank, "the load made new optimizer state tensors")


def test_large_boxes_are_saved_as_chunks_of_bounded_size(tmp_path: Path) -> None:
    full = torch.randn(7, 3, 10)
    shard = torch.cat([torch.zeros(2), full.reshape(-1)[13:170]])  # boxes: part of a row, whole rows, part of one
    saved = [Placement("model/t", full.shape, full.dtype, 13, 170, shard, 2)]
    store = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = UniversalSavePlanner(pieces_for(saved), max_chunk_bytes=50)
        dcp.save({}, storage_writer=FileSystemWriter(store), planner=planner, no_dist=True)
    chunks = safe_dcp.read_metadata(store).state_dict_metadata["model/t"].chunks  # type: ignore[union-attr]
    assert len(chunks) > 3 and all(4 * torch.Size(c.sizes).numel() <= 50 for c in chunks)
    into = torch.full((170 - 13,), -1.0)
    safe_dcp.load_planned(
        store, UniversalLoadPlanner(pieces_for([Placement("model/t", full.shape, full.dtype, 13, 170, into)]))
    )
    assert torch.equal(into, full.reshape(-1)[13:170])
