"""A checkpoint carrying an arbitrary pickled object is refused with a clear error and runs no code.

Each test plants an object whose unpickling would call ``os.mkdir(marker)`` into one file of a real checkpoint,
re-records the digests (as an attacker editing ``meta.json`` would), and checks that loading raises
UnsafeCheckpointError, that the marker does not exist and that the model is unchanged.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from rel_testlib import RunsCode, assert_unchanged, fsdp_model, plain_run, rewrite_digests, snapshot

from shardkit.checkpoint import UnsafeCheckpointError, load_checkpoint, safe_dcp, safe_load, save_checkpoint
from shardkit.distributed import DummyProcessGroup


def test_the_planted_file_really_runs_code_under_an_unsafe_load(tmp_path: Path) -> None:
    """The control: plain ``torch.load(weights_only=False)`` of the planted file does run the code."""
    marker = tmp_path / "ran"
    torch.save({"w": RunsCode(str(marker))}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("name", ["common.pt", "ranks/rank_00000.pt"])
def test_pickled_object_in_any_file_is_refused_and_runs_nothing(tmp_path: Path, name: str) -> None:
    run = plain_run(seed=0)
    directory = save_checkpoint(tmp_path / "ckpt", step=1, model=run.model, optimizer=run.optimizer, scaler=run.scaler)
    marker = tmp_path / "ran"
    original = torch.load(directory / name, weights_only=True)
    original["planted"] = RunsCode(str(marker))
    torch.save(original, directory / name)
    rewrite_digests(directory)

    target = plain_run(seed=1)
    before = snapshot(target)
    with pytest.raises(UnsafeCheckpointError, match="refuses") as info:
        load_checkpoint(directory, model=target.model, optimizer=target.optimizer, scaler=target.scaler)
    assert name.split("/")[-1] in str(info.value)
    assert not marker.exists()
    assert_unchanged(target, before)


def test_safe_load_refuses_a_bare_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(RunsCode(str(marker)), protocol=2))
    with pytest.raises(UnsafeCheckpointError, match="weights_only"):
        safe_load(tmp_path / "evil.pkl", "a file")
    assert not marker.exists()


def _fsdp_checkpoint(tmp_path: Path) -> tuple[Path, object]:
    model = fsdp_model(seed=0, group=DummyProcessGroup(rank=0, size=1))
    directory = save_checkpoint(tmp_path / "ckpt", step=1, model=model)
    return directory, model


def test_dcp_index_carrying_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    directory, _ = _fsdp_checkpoint(tmp_path)
    marker = tmp_path / "ran"
    (directory / "dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode(str(marker))))
    rewrite_digests(directory)
    target = fsdp_model(seed=1, group=DummyProcessGroup(rank=0, size=1))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(UnsafeCheckpointError, match=r"(posix|os)\.mkdir"):
        load_checkpoint(directory, model=target)
    assert not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_real_dcp_index_passes_the_allow_list(tmp_path: Path) -> None:
    directory, _ = _fsdp_checkpoint(tmp_path)
    shapes = safe_dcp.global_shapes(directory / "dcp")
    assert shapes["model/0.weight"] == (8, 6) and shapes["model/5.bias"] == (3,)


def test_dcp_entry_carrying_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    # A DCP checkpoint whose non-tensor entry is a pickled object (DCP itself would load it with weights_only=False).
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"x": torch.ones(2), "evil": RunsCode(str(marker))}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    state = {"x": torch.zeros(2), "evil": None}
    with pytest.raises(UnsafeCheckpointError, match="entry evil"):
        safe_dcp.load(state, tmp_path / "d")
    assert not marker.exists()
