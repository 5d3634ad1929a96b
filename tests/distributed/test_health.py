"""Desynchronised or failed ranks produce errors that name them, within a bounded time, on every rank."""

import time

import pytest
import torch

from shardkit.distributed import CollectiveMismatchError, RankFailedError, check_collectives
from shardkit.distributed import collectives as C
from shardkit.testing import DistributedTestError, run_distributed


def _one_rank_skips_then_continues(rank: int, world_size: int) -> str:
    with check_collectives(timeout_s=10):
        C.all_reduce(torch.ones(4), label="first")
        try:
            if rank != 1:
                C.all_reduce(torch.ones(4), label="skipped-by-rank-1")
            C.broadcast(torch.ones(2), src_in_group=0, label="after")
        except CollectiveMismatchError as err:
            return str(err)
    return "no error"


def test_skipped_collective_is_named_on_every_rank() -> None:
    messages = run_distributed(_one_rank_skips_then_continues, 2, timeout_s=30)
    for message in messages:
        assert "first mismatch at rank 1" in message
        assert "skipped-by-rank-1" in message


def _one_rank_skips_then_stops(rank: int, world_size: int) -> str:
    with check_collectives(timeout_s=3):
        C.all_reduce(torch.ones(4), label="step1")
        if rank == 1:
            time.sleep(8)  # alive, but never issues the next collective
            return "stalled"
        try:
            C.all_reduce(torch.ones(4), label="step2")
        except RuntimeError as err:
            return str(err)
    return "no error"


def test_timeout_reports_where_each_rank_is() -> None:
    start = time.monotonic()
    messages = run_distributed(_one_rank_skips_then_stops, 2, timeout_s=30)
    assert time.monotonic() - start < 25
    assert "rank 1 last entered: #1 all_reduce:step1" in messages[0]
    assert "rank 0 last entered: #2 all_reduce:step2" in messages[0]


def _one_rank_raises(rank: int, world_size: int) -> str:
    C.all_reduce(torch.ones(1))
    if rank == 1:
        raise ValueError("bad batch on purpose")
    time.sleep(0.5)
    try:
        C.all_reduce(torch.ones(1), label="next")
    except RankFailedError as err:
        return str(err)
    return "no error"


def test_dead_rank_does_not_hang_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_one_rank_raises, 2, timeout_s=60)
    # Far below the 60 s collective timeout: rank 0's next collective failed as soon as rank 1 was gone.
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "rank 1 raised" in message and "bad batch on purpose" in message
    assert "rank 0 raised" not in message and "rank 0 did not finish" not in message


def _failed_rank_message(rank: int, world_size: int) -> str:
    return _one_rank_raises(rank, world_size) if rank == 0 else _raise_quietly()


def _raise_quietly() -> str:
    from shardkit.distributed import report_failure

    C.all_reduce(torch.ones(1))
    report_failure(ValueError("bad batch on purpose"))
    return "failed"


def test_rank_failed_error_names_rank_and_exception() -> None:
    messages = run_distributed(_failed_rank_message, 2, timeout_s=5)
    assert "rank 1 failed first: ValueError: bad batch on purpose" in messages[0]
