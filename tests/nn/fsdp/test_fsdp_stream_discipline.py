"""FSDP's side-stream buffers are handed to the compute stream before they are freed, checked on CPU.

On CUDA the full flat parameter is allocated on the gather stream and the reduced gradient shard on the reduce
stream; both are then read by kernels queued on the compute stream. Freeing such a buffer without
``record_stream(compute)`` lets the caching allocator give its block to the side stream's next gather while those
kernels may still run: a silent wrong result. CPU has no streams, so here the side streams are fakes that log what
FSDP asks of them, at world size 2 on gloo, and the log is checked: every full parameter freed by ``reshard`` was
recorded on the compute stream after its gather was joined; every reduced shard likewise; every full gradient was
recorded on the reduce stream that reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import comm_context
from shardkit.nn.fsdp.handle import FlatParamHandle
from shardkit.testing import run_distributed


class _Stream:
    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name, self.log = name, log
        self.device = torch.device("cpu")

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait", self.name, other.name))


def _fsdp_step_with_logged_streams(rank: int, world_size: int, drop_full_record: bool) -> list[tuple[Any, ...]]:
    log: list[tuple[Any, ...]] = []
    compute = _Stream("compute", log)
    sides: dict[int, _Stream] = {}
    mp = pytest.MonkeyPatch()

    @contextlib.contextmanager
    def issue(self: comm_context.SideStream, device: torch.device) -> Iterator[Any]:
        stream = sides.setdefault(id(self), _Stream(f"side{len(sides)}", log))
        stream.wait_stream(compute)
        log.append(("issue", stream.name))
        yield stream
        log.append(("end", stream.name))

    dropping: list[bool] = []  # non-empty while the handover being left out runs

    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        if not dropping:
            log.append(("record", tensor.untyped_storage().data_ptr(), stream.name))

    wait_unsharded = FlatParamHandle.wait_unsharded

    def wait_unsharded_without_record(self: FlatParamHandle) -> None:
        dropping.append(True)
        try:
            wait_unsharded(self)
        finally:
            dropping.pop()

    resize = torch.UntypedStorage.resize_

    def logged_resize(storage: torch.UntypedStorage, size: int) -> Any:
        if size == 0 and storage.nbytes() > 0:
            log.append(("free", storage.data_ptr()))
        return resize(storage, size)

    mp.setattr(comm_context.SideStream, "issue", issue)
    mp.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    mp.setattr(torch.Tensor, "record_stream", record_stream)
    mp.setattr(torch.UntypedStorage, "resize_", logged_resize)
    if drop_full_record:
        mp.setattr(FlatParamHandle, "wait_unsharded", wait_unsharded_without_record)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        model[0], model[2] = FSDP(model[0]), FSDP(model[2])
        wrapped = FSDP(model)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        for _ in range(2):
            optimizer.zero_grad()
            wrapped(torch.randn(3, 8)).sum().backward()
            optimizer.step()
    finally:
        mp.undo()
    return log


def _check(log: list[tuple[Any, ...]]) -> list[str]:
    """What the log shows was freed or read without being handed over."""
    problems, recorded, frees = [], set(), 0
    for entry in log:
        if entry[0] == "record" and entry[2] == "compute":
            recorded.add(entry[1])
        elif entry[0] == "free":
            frees += 1
            if entry[1] not in recorded:
                problems.append(f"freed {entry[1]:#x} (allocated on a side stream) with no record_stream(compute)")
            recorded.discard(entry[1])
    side_records = [e for e in log if e[0] == "record" and e[2] != "compute"]
    if frees == 0 or not side_records:
        problems.append(f"the run exercised nothing: {frees} frees, {len(side_records)} side-stream records")
    return problems


def test_side_stream_buffers_are_recorded_on_the_compute_stream_before_they_are_freed() -> None:
    for log in run_distributed(_fsdp_step_with_logged_streams, 2, False, timeout_s=120):
        assert _check(log) == []
        joins = [e for e in log if e[0] == "wait" and e[1] == "compute"]
        assert joins, "the compute stream never waited for a side stream"
        # Reduced shards (allocated on the reduce stream, read as .grad by the optimizer) are handed over too:
        # more compute-stream records than full parameters freed.
        compute_records = sum(1 for e in log if e[0] == "record" and e[2] == "compute")
        assert compute_records > sum(1 for e in log if e[0] == "free")


def test_the_check_catches_a_full_parameter_freed_without_its_record() -> None:
    """Drop the record ``wait_unsharded`` makes (the bug the review found) and the check reports the frees."""
    for log in run_distributed(_fsdp_step_with_logged_streams, 2, True, timeout_s=120):
        assert any("no record_stream(compute)" in p for p in _check(log))
