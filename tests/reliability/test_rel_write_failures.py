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

#: The size limit of the failing saves: far above the harness's own store file, which rank 0 also appends to while
#: the ranks meet (a limit below it would fail the store, not the checkpoint), and below what the victim file holds.
LIMIT = 1 << 20


def _save_over_a_size_limit(rank: int, world_size: int, root: str, victim: str) -> str:
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
    model, optimizer, _ = get_strategy("ddp").build(net, OptimizerSpec(torch.optim.Adam, {"lr": 0.01}), None, {})
    model(torch.ones(2, 512)).sum().backward()
    optimizer.step()
    # The rank file is written before the DCP file: a large data position makes it the one that overflows.
    position = torch.zeros(1 << 19) if victim == "rank file" else None
    first = save_checkpoint(step_directory(root, 1), step=1, model=model, optimizer=optimizer, data_position=position)
    sizes = {
        name: (first / sub).stat().st_size
        for name, sub in [("rank", "ranks/rank_00000.pt"), ("dcp", "dcp/__0_0.distcp")]
    }
    assert sizes["dcp"] > LIMIT and (sizes["rank"] > LIMIT) == (victim == "rank file"), sizes
    try:
        if rank == 0:  # as `ulimit -f` does, without the signal that would kill the process outright
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))
        try:
            save_checkpoint(step_directory(root, 2), step=2, model=model, optimizer=optimizer, data_position=position)
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
        assert f"RLIMIT_FSIZE) is {LIMIT} bytes" in message
        assert "inline_container" not in message
    assert latest_checkpoint(tmp_path) == step_directory(tmp_path, 1)  # the earlier checkpoint stands
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
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
