"""Labelled collectives: identity on a size-1 dummy group, correct on gloo, metered and delayable."""

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from link_spy import link_sleeps

from shardkit.distributed import DummyProcessGroup, comm_delay, count_comm_bytes, group_rank, group_size
from shardkit.distributed import collectives as C
from shardkit.testing import run_distributed
from shardkit.utils.wrapper_tensor import NO_TORCH_FUNCTION, new_wrapper


def test_dummy_group_collectives_are_identity() -> None:
    group = DummyProcessGroup(rank=0, size=1)
    full = torch.arange(6.0)
    shard = torch.empty(6)
    C.reduce_scatter_tensor(shard, full, group=group)
    assert torch.equal(shard, full)
    out = torch.empty(6)
    C.all_gather_into_tensor(out, full, group=group).wait()
    assert torch.equal(out, full)
    assert group_rank(group) == 0 and group_size(group) == 1


def test_dummy_group_larger_than_one_refuses_to_communicate() -> None:
    with pytest.raises(RuntimeError, match="only describes a sharding"):
        C.all_reduce(torch.ones(2), group=DummyProcessGroup(rank=1, size=4))


def test_bad_dummy_group_arguments() -> None:
    with pytest.raises(ValueError, match="0 <= rank < size"):
        DummyProcessGroup(rank=2, size=2)


def test_missing_process_group_error_says_what_to_do() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        C.all_reduce(torch.ones(1))


def _collectives_and_meter(rank: int, world_size: int) -> dict[str, object]:
    with count_comm_bytes() as meter:
        t = torch.full((4,), float(rank))
        C.all_reduce(t, label="sum")
        shard = torch.full((2,), float(rank))
        full = torch.empty(2 * world_size)
        handle = C.all_gather_into_tensor(full, shard, async_op=True)
        handle.wait()
        out = torch.empty(2)
        C.reduce_scatter_tensor(out, torch.arange(2.0 * world_size), group=None)
        b = torch.full((3,), float(rank))
        C.broadcast(b, src_in_group=world_size - 1)
    return {
        "sum": t.tolist(),
        "gathered": full.tolist(),
        "scattered": out.tolist(),
        "bcast": b.tolist(),
        "calls": dict(meter.calls),
        "wire": meter.total_wire_bytes,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_on_gloo(world_size: int) -> None:
    results = run_distributed(_collectives_and_meter, world_size)
    total = float(sum(range(world_size)))
    for rank, res in enumerate(results):
        assert res["sum"] == [total] * 4
        assert res["gathered"] == [float(r) for r in range(world_size) for _ in range(2)]
        expected_scatter = [world_size * float(2 * rank + i) for i in range(2)]
        assert res["scattered"] == expected_scatter
        assert res["bcast"] == [float(world_size - 1)] * 3
        assert res["calls"] == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}
        n = world_size
        expected_wire = (
            int(2 * (n - 1) / n * 16) + int((n - 1) / n * 8 * n) + int((n - 1) / n * 8 * n) + int((n - 1) / n * 12)
        )
        assert res["wire"] == expected_wire


def _delayed_async_overlaps(rank: int, world_size: int) -> dict[str, list[float]]:
    with comm_delay(latency_s=0.2), link_sleeps() as slept:
        start = time.perf_counter()
        handle = C.all_reduce(torch.ones(8), async_op=True)
        slept_in_issue = list(slept)
        time.sleep(0.2)  # "compute" that the simulated link overlaps with
        handle.wait()
        elapsed = time.perf_counter() - start
    return {"issue": slept_in_issue, "wait": slept[len(slept_in_issue) :], "elapsed": [elapsed]}


def test_comm_delay_is_asynchronous() -> None:
    for got in run_distributed(_delayed_async_overlaps, 2):
        # Issuing never blocks on the simulated link; by the time wait() runs, the 0.2 s of compute has covered
        # the 0.2 s link, so wait() has at most a sliver left (a blocking delay would sleep the whole 0.2 s).
        assert got["issue"] == []
        assert sum(got["wait"]) < 0.1, got
        assert got["elapsed"][0] >= 0.2  # the link's latency was honoured (sleeps only ever run long)


def _direct_sends(rank: int, world_size: int) -> dict[str, object]:
    with count_comm_bytes() as meter:
        handles = []
        received = []
        for root in range(world_size):  # every rank the root of its own tensor, as OSS's exchange
            t = torch.full((5,), float(root)) if rank == root else torch.zeros(5)
            handles.append(C.broadcast(t, root, async_op=True, label="direct", by_sends=True))
            received.append(t)
        C.wait_all(handles)
        summed = torch.arange(4.0) * (rank + 1)
        C.reduce(summed, world_size - 1, label="direct", by_sends=True)
    return {
        "received": [t.tolist() for t in received],
        "summed": summed.tolist(),
        "calls": dict(meter.calls),
        "wire": meter.total_wire_bytes,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_broadcast_and_reduce_by_sends(world_size: int) -> None:
    results = run_distributed(_direct_sends, world_size)
    n = world_size
    total = float(sum(range(1, n + 1)))
    for rank, res in enumerate(results):
        assert res["received"] == [[float(root)] * 5 for root in range(n)]
        # the destination holds the sum; every other rank's buffer is left as it was
        expected = [total * i for i in range(4)] if rank == n - 1 else [float(i * (rank + 1)) for i in range(4)]
        assert res["summed"] == expected
        assert res["calls"] == {"broadcast": n, "reduce": 1}  # counted as the collectives they replace
        assert res["wire"] == n * int((n - 1) / n * 20) + int((n - 1) / n * 16)


def _late_rank_barrier(rank: int, world_size: int) -> dict[str, float]:
    if rank == 1:
        time.sleep(0.3)
    arrived = time.monotonic()  # one clock for every process on the machine: the ranks' readings compare
    C.barrier(label="late")
    return {"arrived": arrived, "left": time.monotonic()}


def test_barrier_waits_for_every_rank() -> None:
    early, late = run_distributed(_late_rank_barrier, 2)
    assert early["left"] >= late["arrived"], (early, late)  # nobody leaves before the last rank arrives
    C.barrier(DummyProcessGroup(rank=0, size=1))  # nothing to wait for in a group of one


class _DeviceLooking(torch.Tensor):
    """Metadata of a CUDA tensor with no data: what a gloo send would be handed on a GPU host."""

    __torch_function__ = NO_TORCH_FUNCTION

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise AssertionError(f"the transfer reached torch ({func}) instead of being refused")


def _device_tensor_on_gloo(rank: int, world_size: int) -> dict[str, str]:
    fake_cuda = new_wrapper(_DeviceLooking, (4,), torch.float32, torch.device("cuda", 0), False)
    errors = {}
    for op in ("send", "recv"):
        try:
            if op == "send":
                C.send(fake_cuda, dst=1 - rank, label="probe")
            else:
                C.recv(fake_cuda, src=1 - rank, label="probe")
        except ValueError as err:
            errors[op] = str(err)
    C.all_reduce(torch.ones(1))  # the group still works: nothing was posted
    return errors


def test_gloo_point_to_point_refuses_cuda_tensors_on_every_rank() -> None:
    for errors in run_distributed(_device_tensor_on_gloo, 2, timeout_s=60):
        assert set(errors) == {"send", "recv"}
        assert all("gloo sends and receives CPU tensors only" in e and "cuda:0" in e for e in errors.values())
