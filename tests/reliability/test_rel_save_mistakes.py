"""Issue 32, items 3, 4 and 13: saves that went wrong without a word.

3. A torchrun launch (``WORLD_SIZE=2``) without ``init_process_group``: every process would write a world-size-1
   checkpoint into the same directory. Refused, naming the launch and what to call.
4. Ranks passing different directories: one directory existed, and rank 1 was told it saved one that does not.
   Refused on every rank before anything is written; on load (where every rank silently loaded rank 0's) too.
13. A ``torch.compile``d model's checkpoint was keyed ``_orig_mod.*``. The compile wrapper is looked through on
   save and load, and a checkpoint keyed that way by an earlier version still loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rel_testlib import build, fsdp_model, release, tiny_net

from shardkit.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, step_directory
from shardkit.checkpoint.api import save_source
from shardkit.checkpoint.tools.write import StaticSource
from shardkit.checkpoint.universal.source import Held, Span
from shardkit.launch import launch_local
from shardkit.testing import run_distributed


# ------------------------------------------------------------------ item 3: a launch without a process group
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_multi_process_launch_without_a_process_group_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: str
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun --nproc-per-node 2 sets in each process
    monkeypatch.setenv("RANK", rank)
    model = tiny_net(0)
    with pytest.raises(CheckpointError, match=r"WORLD_SIZE=2.*no process group.*init_process_group"):
        save_checkpoint(tmp_path / "ckpt", step=1, model=model)
    assert not any(tmp_path.iterdir())  # nothing written, not even the temporary directory


def _save_without_a_process_group(root: str) -> str:
    try:
        save_checkpoint(Path(root) / "ckpt", step=1, model=tiny_net(0))
    except CheckpointError as err:
        return str(err)
    return "saved"


def test_a_torchrun_launch_without_init_process_group_is_refused_in_every_process(tmp_path: Path) -> None:
    messages = launch_local(_save_without_a_process_group, 2, str(tmp_path))  # torchrun's own launcher
    for rank, message in enumerate(messages):
        assert f"launched as rank {rank} of WORLD_SIZE=2 processes" in message
    assert not any(tmp_path.iterdir())


def test_a_single_process_launch_still_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert (save_checkpoint(tmp_path / "ckpt", step=1, model=tiny_net(0)) / "meta.json").exists()


# ------------------------------------------------------------------ item 4: ranks naming different directories
def _save_with_own_step(rank: int, world_size: int, root: str) -> str:
    run = build("ddp", seed=0)
    try:
        save_checkpoint(step_directory(root, 10 + rank), step=10 + rank, model=run.model, optimizer=run.optimizer)
    except CheckpointError as err:
        return str(err)
    finally:
        release(run)
    return "saved"


def test_ranks_passing_different_directories_are_refused_on_every_rank(tmp_path: Path) -> None:
    messages = run_distributed(_save_with_own_step, 2, str(tmp_path), timeout_s=60)
    for message in messages:
        assert "the ranks passed different directories" in message
        assert "rank 0: " in message and "step_00000010" in message
        assert "rank 1: " in message and "step_00000011" in message
    assert not any(tmp_path.iterdir())  # nothing written on any rank


def _load_with_own_directory(rank: int, world_size: int, root: str) -> tuple[str, bool]:
    run = build("ddp", seed=0)
    for step in (1, 2):
        save_checkpoint(step_directory(root, step), step=step, model=run.model)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    try:
        load_checkpoint(step_directory(root, 1 + rank), model=run.model)  # rank 0 step 1, rank 1 step 2
        message = "loaded"
    except CheckpointError as err:
        message = str(err)
    finally:
        release(run)
    return message, all(torch.equal(v, before[k]) for k, v in run.model.state_dict().items())


def test_ranks_loading_different_directories_are_refused_on_every_rank(tmp_path: Path) -> None:
    for message, unchanged in run_distributed(_load_with_own_directory, 2, str(tmp_path), timeout_s=60):
        assert "load_checkpoint: the ranks passed different directories" in message
        assert "step_00000001" in message and "step_00000002" in message and "Nothing was loaded" in message
        assert unchanged


# ------------------------------------------------------------------ item 13: torch.compile'd models
def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    """One Adam step on made-up gradients (the model is never run, so compiling stays lazy and fast)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer


def test_a_compiled_models_checkpoint_loads_into_the_plain_model(tmp_path: Path) -> None:
    plain = tiny_net(0)
    compiled = torch.compile(plain)
    optimizer = _trained(compiled)
    directory = save_checkpoint(tmp_path / "ckpt", step=1, model=compiled, optimizer=optimizer)
    target = tiny_net(1)
    target_optimizer = torch.optim.Adam(target.parameters(), lr=0.01)
    load_checkpoint(directory, model=target, optimizer=target_optimizer)
    want = _values(plain)
    assert all(torch.equal(v, want[k]) for k, v in _values(target).items())
    assert target_optimizer.state_dict()["state"][0]["step"] == 1


def test_a_plain_models_checkpoint_loads_into_the_compiled_model(tmp_path: Path) -> None:
    plain = tiny_net(0)
    optimizer = _trained(plain)
    directory = save_checkpoint(tmp_path / "ckpt", step=1, model=plain, optimizer=optimizer)
    target = tiny_net(1)
    compiled = torch.compile(target)
    target_optimizer = torch.optim.Adam(compiled.parameters(), lr=0.01)
    load_checkpoint(directory, model=compiled, optimizer=target_optimizer)
    want = _values(plain)
    assert all(torch.equal(v, want[k]) for k, v in _values(target).items())
    assert target_optimizer.state_dict()["state"][0]["step"] == 1


def test_a_checkpoint_keyed_orig_mod_by_an_earlier_version_still_loads(tmp_path: Path) -> None:
    source = tiny_net(0)
    held = [Held(t, (Span(f"_orig_mod.{name}", t.shape, 0, t.numel()),)) for name, t in source.state_dict().items()]
    directory = save_source(tmp_path / "ckpt", StaticSource(held), step=0)
    target = tiny_net(1)
    load_checkpoint(directory, model=target)
    want = _values(source)
    assert all(torch.equal(v, want[k]) for k, v in _values(target).items())


def _save_compiled_fsdp(rank: int, world_size: int, root: str) -> None:
    model = fsdp_model(seed=0)  # tiny_net(0) with a nested unit
    save_checkpoint(Path(root) / "ckpt", step=1, model=torch.compile(model))


def test_a_compiled_fsdp_models_checkpoint_loads_into_the_plain_model(tmp_path: Path) -> None:
    run_distributed(_save_compiled_fsdp, 2, str(tmp_path), timeout_s=60)
    target = tiny_net(1)
    load_checkpoint(tmp_path / "ckpt", model=target)
    want = _values(tiny_net(0))
    assert all(torch.equal(v, want[k]) for k, v in _values(target).items())
