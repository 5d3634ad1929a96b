"""Each call every rank must make, made by rank 0 only: rank 0 fails after the configured deadline naming the call
and rank 1, and rank 1 fails at once when it makes the call late; nothing hangs (issue 23, items 1-3)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from rel_testlib import Run, build, release, train

from shardkit.checkpoint import save_checkpoint
from shardkit.checkpoint.api import load_checkpoint
from shardkit.distributed.arrival import ENV_TIMEOUT, ENV_WARN_AFTER
from shardkit.distributed.health import failed_ranks
from shardkit.testing import run_distributed

FAST = {ENV_TIMEOUT: "2", ENV_WARN_AFTER: "0.5"}


def _calls(directory: str) -> dict[str, tuple[str, str, Callable[[Run], Any]]]:
    """Per case: the strategy, the name the error must give, and the call."""

    def save(run: Run) -> Any:
        return save_checkpoint(directory, step=1, model=run.model, optimizer=run.optimizer)

    def load(run: Run) -> Any:
        return load_checkpoint(directory, model=run.model, optimizer=run.optimizer)

    def summon(run: Run) -> Any:
        with run.model.summon_full_params():
            return None

    return {
        "save_fsdp": ("fsdp", "save_checkpoint()", save),
        "save_ddp": ("ddp", "save_checkpoint()", save),
        "load_oss_sdp": ("oss_sdp", "load_checkpoint()", load),
        "oss_consolidate": ("oss", "OSS.consolidate_state_dict()", lambda run: run.optimizer.consolidate_state_dict()),
        "fsdp_summon": ("fsdp", "FullyShardedDataParallel.summon_full_params()", summon),
        "fsdp_optim": (
            "fsdp",
            "FullyShardedDataParallel.gather_full_optim_state_dict()",
            lambda run: run.model.gather_full_optim_state_dict(run.optimizer),
        ),
        "smp_state_dict": ("smp", "DistributedModel.state_dict()", lambda run: run.model.state_dict()),
        "smp_optimizer": ("smp", "DistributedOptimizer.state_dict()", lambda run: run.optimizer.state_dict()),
    }


def _attempt(call: Callable[[Run], Any], run: Run) -> Optional[str]:
    try:
        call(run)
    except RuntimeError as err:
        return str(err)
    return None


def _rank_zero_only(rank: int, world_size: int, case: str, directory: str) -> tuple[Optional[str], bool]:
    strategy, _, call = _calls(directory)[case]
    run = build(strategy, seed=0)
    train(run, range(1), rank)
    if case.startswith("load"):
        save_checkpoint(directory, step=0, model=run.model, optimizer=run.optimizer)  # every rank: fine
    if rank == 0:
        error = _attempt(call, run)
    else:
        while 0 not in failed_ranks():  # rank 1 is elsewhere until rank 0 has given up
            time.sleep(0.05)
        error = _attempt(call, run)
    published = any(p.name.startswith(".") for p in Path(directory).parent.iterdir())
    release(run)
    return error, published


@pytest.mark.parametrize("case", list(_calls("-")))
def test_a_call_made_on_rank_zero_only_fails_on_both_ranks_naming_it(case: str, tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    _, what, _ = _calls(directory)[case]
    (error0, leftovers0), (error1, _) = run_distributed(
        _rank_zero_only, 2, case, directory, timeout_s=60, rank_env=[FAST, FAST]
    )
    assert error0 is not None and error1 is not None
    assert f"{what} was called on rank(s) [0], but rank(s) [1] of group [0, 1] did not call it within 2 s" in error0
    assert "Call it on every rank" in error0 and ENV_TIMEOUT in error0
    assert error1.startswith(f"rank 1 reached {what} after the other ranks gave up on it")
    assert not leftovers0  # nothing half-written: the check runs before any file or collective
    if case.startswith("save"):
        assert not Path(directory).exists()


def test_fsdp_state_dict_costs_a_few_store_round_trips() -> None:
    """The check's cost, counted rather than timed: one state_dict at 2 ranks adds a bounded number of store
    operations (it must not grow with the model's units)."""
    counts = run_distributed(_count_store_operations, 2, timeout_s=60)
    for count in counts:
        assert 3 <= count <= 40, count


def _count_store_operations(rank: int, world_size: int) -> int:
    from shardkit.distributed import arrival

    run = build("fsdp", seed=0)
    train(run, range(1), rank)
    store = arrival.default_store()
    calls = 0
    original = arrival.default_store

    class Counting:
        def __getattr__(self, name: str) -> Any:
            nonlocal calls
            calls += 1
            return getattr(store, name)

    arrival.default_store = lambda: Counting()  # type: ignore[assignment,return-value]
    try:
        run.model.state_dict()
    finally:
        arrival.default_store = original
    torch.distributed.barrier()
    return calls
