"""Issue 23, items 5 and 6: an imported checkpoint never overrides the loader's seed; an edited meta.json is
refused; latest_checkpoint skips damaged checkpoints saying so, and load_checkpoint(root) falls back to the newest
intact one."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from rel_testlib import build, plain_run, release, tiny_net, train

from shardkit.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_directory,
    verify_checkpoint,
)
from shardkit.checkpoint.files import safe_load
from shardkit.checkpoint.tools.import_ import import_checkpoint
from shardkit.testing import run_distributed


def _imported(tmp_path: Path) -> Path:
    torch.save(tiny_net(0).state_dict(), tmp_path / "model.pt")
    torch.manual_seed(12345)  # the import command's own generator state must not travel
    return import_checkpoint(tmp_path / "model.pt", tmp_path / "imported")


def test_an_imported_checkpoint_leaves_the_callers_seed_alone(tmp_path: Path) -> None:
    directory = _imported(tmp_path)
    assert safe_load(directory / "ranks" / "rank_00000.pt", "rank state")["rng"] is None
    draws = []
    for seed in (1, 2):
        model = tiny_net(3)  # seeds torch itself: before the caller's seed
        torch.manual_seed(seed)
        info = load_checkpoint(directory, model=model)
        assert not info.rng_restored
        draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1])  # seeds 1 and 2 still give different streams
    torch.manual_seed(1)
    assert torch.equal(torch.rand(4), draws[0])


def test_a_saved_checkpoint_still_restores_its_streams(tmp_path: Path) -> None:
    run = plain_run(seed=0)
    torch.manual_seed(7)
    directory = save_checkpoint(tmp_path / "ckpt", step=1, model=run.model, optimizer=run.optimizer)
    expected = torch.rand(4)
    torch.manual_seed(99)
    info = load_checkpoint(directory, model=run.model, optimizer=run.optimizer)
    assert info.rng_restored and torch.equal(torch.rand(4), expected)


def _save_two(tmp_path: Path) -> tuple[Path, Path]:
    run = plain_run(seed=0)
    older = save_checkpoint(step_directory(tmp_path, 1), step=1, model=run.model, optimizer=run.optimizer)
    newer = save_checkpoint(step_directory(tmp_path, 2), step=2, model=run.model, optimizer=run.optimizer)
    return older, newer


@pytest.mark.parametrize("edit", [{"step": 7}, {"world_size": 4}])
def test_an_edited_meta_json_is_refused(tmp_path: Path, edit: dict[str, int]) -> None:
    _, newer = _save_two(tmp_path)
    meta = json.loads((newer / "meta.json").read_text())
    (newer / "meta.json").write_text(json.dumps({**meta, **edit}, indent=2))
    with pytest.raises(CorruptCheckpointError, match="was changed after it was written"):
        verify_checkpoint(newer)
    with pytest.raises(CorruptCheckpointError, match="was changed after it was written"):
        load_checkpoint(newer, model=tiny_net(0))
    with pytest.warns(UserWarning, match=f"skipping checkpoint {newer}.*changed after it was written"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"


def test_a_reformatted_meta_json_still_loads(tmp_path: Path) -> None:
    _, newer = _save_two(tmp_path)
    meta = json.loads((newer / "meta.json").read_text())
    (newer / "meta.json").write_text(json.dumps(dict(reversed(list(meta.items()))), indent=4))
    assert verify_checkpoint(newer).step == 2


def test_latest_checkpoint_skips_a_truncated_one_and_says_so(tmp_path: Path) -> None:
    older, newer = _save_two(tmp_path)
    common = newer / "common.pt"
    common.write_bytes(common.read_bytes()[:-10])
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step_00000002.*truncated"):
        assert latest_checkpoint(tmp_path) == older


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_load_from_a_root_falls_back_to_the_newest_intact_checkpoint(tmp_path: Path) -> None:
    older, newer = _save_two(tmp_path)
    _flip_a_byte(newer / "common.pt")  # same size: only the SHA-256 finds it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest_checkpoint(tmp_path) == newer  # the cheap check cannot tell
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step_00000002.*SHA-256"):
        assert latest_checkpoint(tmp_path, hashes=True) == older
    with pytest.warns(UserWarning, match=r"load_checkpoint: skipping .*step_00000002, which failed verification"):
        info = load_checkpoint(tmp_path, model=tiny_net(0))
    assert info.path == older and info.step == 1
    with pytest.raises(CorruptCheckpointError, match="SHA-256"):
        load_checkpoint(tmp_path, model=tiny_net(0), fall_back=False)
    with pytest.raises(CorruptCheckpointError, match="SHA-256"):
        load_checkpoint(newer, model=tiny_net(0))  # a directory named explicitly never falls back


def test_when_nothing_is_intact_the_error_names_every_skipped_checkpoint(tmp_path: Path) -> None:
    older, newer = _save_two(tmp_path)
    _flip_a_byte(newer / "common.pt")
    _flip_a_byte(older / "common.pt")
    with pytest.warns(UserWarning), pytest.raises(CorruptCheckpointError, match="no intact checkpoint under"):
        load_checkpoint(tmp_path, model=tiny_net(0))


def _fall_back_at_two_ranks(rank: int, world_size: int, root: str) -> tuple[int, int]:
    run = build("ddp", seed=0)
    train(run, range(1), rank)
    save_checkpoint(step_directory(root, 1), step=1, model=run.model, optimizer=run.optimizer)
    newer = save_checkpoint(step_directory(root, 2), step=2, model=run.model, optimizer=run.optimizer)
    torch.distributed.barrier()
    if rank == 0:
        _flip_a_byte(newer / "ranks" / "rank_00001.pt")  # hashed by rank 1 at load
    torch.distributed.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = load_checkpoint(root, model=run.model, optimizer=run.optimizer)
    release(run)
    return info.step, sum("failed verification" in str(w.message) for w in caught)


def test_every_rank_falls_back_together(tmp_path: Path) -> None:
    assert run_distributed(_fall_back_at_two_ranks, 2, str(tmp_path), timeout_s=60) == [(1, 1), (1, 1)]


README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_resume_snippet() -> str:
    section = README.read_text().split("### Checkpoints that survive crashes", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_resume_snippet_starts_from_an_imported_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(tiny_net(0).state_dict(), tmp_path / "model.pt")
    import_checkpoint(tmp_path / "model.pt", tmp_path / "ckpt" / "step_00000000")
    monkeypatch.chdir(tmp_path)
    model = tiny_net(5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scope = {"model": model, "optimizer": optimizer, "train_step": lambda: None, "total_steps": 1}
    with pytest.warns(UserWarning, match="holds weights only: the model is loaded, the optimizer starts afresh"):
        exec(_readme_resume_snippet(), scope)
    assert scope["start"] == 1
    expected = tiny_net(0).state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())
    assert optimizer.state_dict()["state"] == {}


def test_a_checkpoint_saved_without_optimizer_still_refuses_one(tmp_path: Path) -> None:
    run = plain_run(seed=0)
    directory = save_checkpoint(tmp_path / "ckpt", step=1, model=run.model)
    with pytest.raises(CheckpointError, match=r"holds no optimizer state .*optimizer=None"):
        load_checkpoint(directory, model=run.model, optimizer=run.optimizer)


def test_the_readme_restart_text_sets_the_rendezvous_variable() -> None:
    section = README.read_text().split("### Checkpoints that survive crashes", 1)[1].split("\n### ", 1)[0]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts N" in section


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    directory = _imported(tmp_path)
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    command = [sys.executable, "-m", "shardkit.checkpoint.cli", "inspect", str(directory)]
    proc = subprocess.Popen(command, stdout=write_end, stderr=subprocess.PIPE, env=env)
    os.close(write_end)
    os.close(read_end)  # the reader is gone before the command writes a byte, as `| head` is after ten lines
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err.decode() and "BrokenPipeError" not in err.decode()
    assert proc.returncode == 141
