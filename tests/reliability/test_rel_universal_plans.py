"""The DCP plans of the universal layout, in one process: flat ranges saved as boxes by three "ranks" are read
back into two other ranges (any world size, unaligned, with padding around), torch's own ``dcp_to_torch_save``
reads the store, and a missing chunk is refused before anything is read."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from shardkit.checkpoint import CheckpointError, CorruptCheckpointError, safe_dcp
from shardkit.checkpoint.universal.placement import Placement
from shardkit.checkpoint.universal.plans import (
    UniversalLoadPlanner,
    UniversalSavePlanner,
    check_boxes,
    check_pieces,
    pieces_for,
)

FULL = {
    "model/a": torch.arange(35, dtype=torch.float32).reshape(5, 7),
    "model/b": torch.arange(24, dtype=torch.float64).reshape(2, 3, 4) * -1,
    "model/c": torch.tensor(2.5),
}


def _ranges(numel: int, cuts: list[int]) -> list[tuple[int, int]]:
    edges = [0, *cuts, numel]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:])]


def _placements(cuts: dict[str, list[int]], pad: int) -> tuple[list[Placement], dict[tuple[str, int], torch.Tensor]]:
    """Each key cut into flat ranges; each range in its own local buffer with ``pad`` elements either side."""
    placements, locals_ = [], {}
    for key, full in FULL.items():
        for i, (lo, hi) in enumerate(_ranges(full.numel(), cuts.get(key, []))):
            local = torch.full((hi - lo + 2 * pad,), -99.0, dtype=full.dtype)
            local[pad : pad + hi - lo] = full.reshape(-1)[lo:hi]
            placements.append(Placement(key, full.shape, full.dtype, lo, hi, local, pad))
            locals_[(key, i)] = local
    return placements, locals_


def _save(store: Path, placements: list[Placement]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {},
            storage_writer=FileSystemWriter(store),
            planner=UniversalSavePlanner(pieces_for(placements)),
            no_dist=True,
        )


def test_ranges_saved_at_one_split_load_at_another(tmp_path: Path) -> None:
    store = tmp_path / "dcp"
    saved, _ = _placements({"model/a": [11, 23], "model/b": [5, 13]}, pad=0)  # three "ranks"
    _save(store, saved)
    wanted, locals_ = _placements({"model/a": [17], "model/b": [12]}, pad=3)  # two "ranks", padded buffers
    for local in locals_.values():
        local[3:-3].fill_(0.0)
    pieces = pieces_for(wanted)
    metadata = safe_dcp.read_metadata(store)
    check_pieces(pieces, metadata, store, {})
    # [0, 11): row 0 and a part of row 1; [11, 23): the rest of row 1, row 2, part of row 3; [23, 35): the rest.
    assert len(metadata.state_dict_metadata["model/a"].chunks) == 2 + 3 + 2
    safe_dcp.load_planned(store, UniversalLoadPlanner(pieces))
    for key, full in FULL.items():
        cuts = {"model/a": [17], "model/b": [12]}.get(key, [])
        for i, (lo, hi) in enumerate(_ranges(full.numel(), cuts)):
            local = locals_[(key, i)]
            assert torch.equal(local[3 : 3 + hi - lo], full.reshape(-1)[lo:hi]), (key, i)
            assert (local[:3] == -99).all() and (local[3 + hi - lo :] == -99).all()  # padding untouched
    dcp_to_torch_save(store, tmp_path / "all.pt")
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    assert all(torch.equal(everything[k], v) for k, v in FULL.items())


def test_a_missing_chunk_is_refused_before_reading(tmp_path: Path) -> None:
    store = tmp_path / "dcp"
    saved, _ = _placements({"model/a": [11, 23]}, pad=0)
    _save(store, [p for p in saved if not (p.key == "model/a" and p.start == 11)])  # one "rank" never wrote
    wanted, _ = _placements({}, pad=0)
    with pytest.raises(CorruptCheckpointError, match="cover only 23 of the 35 elements"):
        check_pieces(pieces_for(wanted), safe_dcp.read_metadata(store), store, {})


def test_a_one_rank_save_of_part_of_a_key_is_written_and_overlaps_are_refused(tmp_path: Path) -> None:
    # One process writing part of a key is a valid plan on every torch (2.8's DCP refused it; our planner builds
    # that plan itself there); chunks that overlap are refused on every torch, by DCP's check or by ours.
    part, _ = _placements({"model/a": [11]}, pad=0)
    _save(tmp_path / "part", [p for p in part if p.key != "model/a" or p.start == 0])
    chunks = safe_dcp.read_metadata(tmp_path / "part").state_dict_metadata["model/a"].chunks  # type: ignore[union-attr]
    assert sum(torch.Size(c.sizes).numel() for c in chunks) == 11
    full, _ = _placements({}, pad=0)
    overlapping = [*full, Placement("model/a", torch.Size([5, 7]), torch.float32, 3, 10, torch.zeros(7), 0)]
    # torch 2.13 and our own check name the overlap; 2.9 to 2.11 only log it and raise their generic message
    with pytest.raises(CheckpointError, match=r"overlapping chunks|Failed to validate global plan"):
        safe_dcp.save_planned(tmp_path / "overlap", UniversalSavePlanner(pieces_for(overlapping)))


def test_check_boxes_refuses_a_chunk_out_of_bounds_and_overlapping_chunks() -> None:
    def metadata(*boxes: tuple[tuple[int, ...], tuple[int, ...]]) -> Metadata:
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
        return Metadata({"k": TensorStorageMetadata(TensorProperties(), torch.Size([4, 6]), chunks)})

    check_boxes(metadata(((0, 0), (2, 6)), ((2, 0), (1, 6)), ((3, 3), (1, 3))))  # a part, no overlap: valid
    with pytest.raises(ValueError, match="out of bounds"):
        check_boxes(metadata(((3, 0), (2, 6))))
    with pytest.raises(ValueError, match="overlapping chunks"):
        check_boxes(metadata(((0, 0), (2, 6)), ((3, 0), (1, 6)), ((1, 4), (1, 2))))
    check_boxes(metadata(((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (0, 6))))  # side by side, and an empty box
