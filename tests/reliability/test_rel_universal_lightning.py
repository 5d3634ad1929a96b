"""The Lightning FSDP strategy's sharded-checkpoint loader is safe by default: a tampered DCP index or metadata
file is refused before anything is built from it, and runs no code."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from rel_testlib import RunsCode, fsdp_model

from shardkit.checkpoint import UnsafeCheckpointError
from shardkit.distributed import DummyProcessGroup
from shardkit.lightning import fsdp_checkpoint


@pytest.mark.parametrize("planted", [".metadata", "meta.pt"])
def test_tampered_sharded_lightning_checkpoint_is_refused_unread(tmp_path: Path, planted: str) -> None:
    folder = tmp_path / "sharded.ckpt"
    folder.mkdir()
    marker = tmp_path / "ran"
    meta = {"epoch": 1, "shardkit_optimizer_param_groups": []}
    if planted == "meta.pt":
        meta["callbacks"] = RunsCode(str(marker))
    torch.save(meta, folder / fsdp_checkpoint.META_FILE)
    index = pickle.dumps(RunsCode(str(marker))) if planted == ".metadata" else b""
    (folder / ".metadata").write_bytes(index)
    assert fsdp_checkpoint.is_sharded(folder)
    root = fsdp_model(seed=0, group=DummyProcessGroup(rank=0, size=1))
    with pytest.raises(UnsafeCheckpointError):
        fsdp_checkpoint.load_sharded(root, folder, weights_only=None)
    assert not marker.exists()
