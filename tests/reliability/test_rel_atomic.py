"""Atomic saves: an error or a SIGKILL in the middle of save_checkpoint leaves the previous checkpoint intact and
loadable, and the partial one invisible; a finished save replaces an old checkpoint only once it is complete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_testlib import assert_unchanged, plain_run, snapshot, train

from shardkit.checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    api,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_directory,
)
from shardkit.checkpoint.files import write_torch
from shardkit.testing import DistributedTestError, run_distributed
from testkit import bitwise_difference


def _save(root: Path, step: int, run: Any, **kwargs: Any) -> Path:
    return save_checkpoint(
        step_directory(root, step), step=step, model=run.model, optimizer=run.optimizer, scaler=run.scaler, **kwargs
    )


def test_round_trip_restores_state_rng_position_and_extra(tmp_path: Path) -> None:
    run = plain_run(seed=0)
    _save(tmp_path, 7, run, data_position={"epoch": 1, "batch": torch.tensor(5)}, extra=["note", 1.5])
    after_save = torch.rand(3)  # the random stream right after the save
    train(run, range(1, 3), rank=0)
    expected = snapshot(run)

    fresh = plain_run(seed=1)
    info = load_checkpoint(tmp_path, model=fresh.model, optimizer=fresh.optimizer, scaler=fresh.scaler)
    assert torch.equal(torch.rand(3), after_save)  # the RNG continues where the save left it
    assert (info.step, info.world_size, info.strategy, info.extra) == (7, 1, "plain", ["note", 1.5])
    assert info.rng_restored and info.path == step_directory(tmp_path, 7)
    assert info.data_position["epoch"] == 1 and torch.equal(info.data_position["batch"], torch.tensor(5))
    train(fresh, range(1, 3), rank=0)  # same steps, same dropout masks: bitwise the same result
    assert bitwise_difference(expected["model"], snapshot(fresh)["model"]) is None


def test_latest_checkpoint_picks_the_highest_complete_step(tmp_path: Path) -> None:
    run = plain_run(seed=0)
    assert latest_checkpoint(tmp_path) is None and latest_checkpoint(tmp_path / "absent") is None
    for step in (3, 12, 5):
        _save(tmp_path, step, run)
    (tmp_path / "step_00000099").mkdir()  # files but no meta.json: an interrupted save
    (tmp_path / "step_00000099" / "model.pt").write_bytes(b"partial")
    (tmp_path / ".step_00000077.tmp-abc").mkdir()  # a save in progress
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert latest_checkpoint(tmp_path) == step_directory(tmp_path, 12)
    with pytest.raises(CorruptCheckpointError, match=r"no meta.json.*interrupted"):
        load_checkpoint(tmp_path / "step_00000099", model=run.model)
    with pytest.raises(CheckpointNotFoundError):
        load_checkpoint(tmp_path / "empty", model=run.model)


def test_error_mid_save_keeps_previous_checkpoint_and_leaves_no_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = plain_run(seed=0)
    first = _save(tmp_path, 1, run)
    before = snapshot(run)
    train(run, range(1, 2), rank=0)

    def write_or_fail(path: Path, obj: Any) -> None:
        if path.parent.name == "ranks":
            raise OSError("disk full (injected)")
        write_torch(path, obj)

    monkeypatch.setattr(api, "write_torch", write_or_fail)  # model.pt is written, then the rank file fails
    with pytest.raises(CheckpointError, match="disk full"):
        _save(tmp_path, 2, run)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # the partial directory was removed
    fresh = plain_run(seed=1)
    assert load_checkpoint(tmp_path, model=fresh.model, optimizer=fresh.optimizer, scaler=fresh.scaler).step == 1
    assert_unchanged(fresh, before)


def _save_then_die(rank: int, world_size: int, root: str, where: str) -> None:
    from rel_testlib import _arm_save_kill

    run = plain_run(seed=0)
    _save(Path(root), 1, run)
    train(run, range(1, 2), rank=0)
    _arm_save_kill({"where": where, "marker": str(Path(root) / f"killed-{where}")})
    _save(Path(root), 2, run)


@pytest.mark.parametrize("where", ["digests", "publish"])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path: Path, where: str) -> None:
    with pytest.raises(DistributedTestError, match="died"):
        run_distributed(_save_then_die, 1, str(tmp_path), where, timeout_s=60)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".step_00000002.tmp-")]
    assert len(leftovers) == 1 and (leftovers[0] / "dcp" / ".metadata").exists()  # the partial save is on disk ...
    assert ((leftovers[0] / "meta.json").exists()) == (where == "publish")
    assert latest_checkpoint(tmp_path) == step_directory(tmp_path, 1)  # ... but invisible
    run = plain_run(seed=1)
    assert load_checkpoint(tmp_path, model=run.model, optimizer=run.optimizer, scaler=run.scaler).step == 1
    _save(tmp_path, 2, run)  # the retried save clears the leftover
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert latest_checkpoint(tmp_path) == step_directory(tmp_path, 2)


def test_saving_again_replaces_a_checkpoint_only_when_complete(tmp_path: Path) -> None:
    run = plain_run(seed=0)
    target = tmp_path / "ckpt"
    save_checkpoint(target, step=1, model=run.model, optimizer=run.optimizer)
    train(run, range(1, 2), rank=0)
    expected = snapshot(run)
    save_checkpoint(target, step=2, model=run.model, optimizer=run.optimizer)
    assert json.loads((target / "meta.json").read_text())["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    fresh = plain_run(seed=1)
    load_checkpoint(target, model=fresh.model, optimizer=fresh.optimizer)
    assert bitwise_difference(expected["model"], snapshot(fresh)["model"]) is None


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    run = plain_run(seed=0)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("precious")
    with pytest.raises(CheckpointError, match="not a shardkit checkpoint"):
        save_checkpoint(tmp_path / "data", step=0, model=run.model)
    assert (tmp_path / "data" / "train.csv").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    run = plain_run(seed=0)

    class Cursor:
        pass

    with pytest.raises(ValueError, match="data_position must hold only tensors"):
        save_checkpoint(tmp_path / "a", step=1, model=run.model, data_position=Cursor())
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        save_checkpoint(tmp_path / "a", step=-1, model=run.model)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        save_checkpoint(tmp_path / "a", step=1, model=run.optimizer)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
