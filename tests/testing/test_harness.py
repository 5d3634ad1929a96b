"""The multi-process harness: results come back, failures name their rank, hangs fail in bounded time."""

import time

import pytest
import torch
import torch.distributed as dist

from shardkit.testing import DistributedTestError, run_distributed


def _sum_of_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _rank_zero_skips_collective(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)  # alive but never joins the collective: a true hang
    else:
        dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order(world_size: int) -> None:
    expected = float(sum(range(world_size)))
    assert run_distributed(_sum_of_ranks, world_size) == [expected] * world_size


def test_failure_names_rank_and_traceback() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_one_raises, 2, timeout_s=30)
    message = str(info.value)
    assert "rank 1 raised" in message
    assert "boom on purpose" in message


def test_hang_fails_within_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_zero_skips_collective, 2, timeout_s=5)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "rank 0 did not finish" in message
    assert "rank 1 raised" in message
    # The hung rank's stack says where it waits: the sleep in this file's function.
    assert "its stack when it was given up on" in message and "_rank_zero_skips_collective" in message


def _returns_tensor(rank: int, world_size: int) -> torch.Tensor:
    return torch.full((3,), float(rank))


def _no_collectives(rank: int, world_size: int) -> int:
    return rank


def test_tensor_results_survive_worker_exit() -> None:
    results = run_distributed(_returns_tensor, 2)
    assert [r.tolist() for r in results] == [[0.0] * 3, [1.0] * 3]


def test_ranks_without_collectives_finish_cleanly() -> None:
    for _ in range(3):
        assert run_distributed(_no_collectives, 4) == [0, 1, 2, 3]
