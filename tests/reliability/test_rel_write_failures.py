"""Issue 32, item 9: a checkpoint write the OS cuts short says which file and why (EFBIG, ENOSPC, Ctrl-C), on
every rank, and the previous checkpoint stays loadable."""

from __future__ import annotations

import resource
import signal
from pathlib import Path

import pytest
import torch

from shardkit.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint, step_directory
from shardkit.checkpoint.files import write_failure
from shardkit.strategies.registry import OptimizerSpec, get_strategy
from shardkit.testing import run_distributed


def _save_over_a_size_limit(rank: int, world_size: int, root: str, victim: str) -> str:
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    model, optimizer, _ = get_strategy("ddp").build(net, OptimizerSpec(torch.optim.Adam, {"lr": 0.01}), None, {})
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    first = save_checkpoint(step_directory(root, 1), step=1, model=model, optimizer=optimizer)
    sizes = {"rank file": (first / "ranks" / "rank_00000.pt").stat().st_size}
    sizes["dcp"] = (first / "dcp" / "__0_0.distcp").stat().st_size
    assert sizes["dcp"] > 2 * sizes["rank file"]  # so a limit between the two cuts the DCP file only
    limit = sizes["rank file"] // 2 if victim == "rank file" else 2 * sizes["rank file"]
    try:
        if rank == 0:  # as `ulimit -f` does, without the signal that would kill the process outright
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        try:
            save_checkpoint(step_directory(root, 2), step=2, model=model, optimizer=optimizer)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except CheckpointError as err:
        return str(err)
    return "saved"


@pytest.mark.parametrize(("victim", "file"), [("rank file", "rank_00000.pt"), ("dcp", "__0_0.distcp")])
def test_a_file_size_limit_names_the_file_and_efbig_on_every_rank(tmp_path: Path, victim: str, file: str) -> None:
    messages = run_distributed(_save_over_a_size_limit, 2, str(tmp_path), victim, timeout_s=90)
    for message in messages:
        assert f"{file} failed: EFBIG (File too large)" in message, message
        assert "RLIMIT_FSIZE) is" in message
        assert "inline_container" not in message
    assert latest_checkpoint(tmp_path) == step_directory(tmp_path, 1)  # the earlier checkpoint stands
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    assert load_checkpoint(tmp_path, model=net).step == 1


def test_an_interrupted_write_says_so(tmp_path: Path) -> None:
    # What torch.save raises when SIGINT lands inside its write: its own symptom, with the interrupt as context.
    symptom = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    symptom.__context__ = KeyboardInterrupt()
    message = str(write_failure(tmp_path / "x.pt", symptom))
    assert (
        message
        == f"writing {tmp_path / 'x.pt'} failed: interrupted by SIGINT (Ctrl-C, or the launcher stopping the job)"
    )
