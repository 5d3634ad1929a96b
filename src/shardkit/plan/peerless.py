"""A process group of ``world_size`` ranks with one real member: the rank being planned.

The planner runs one rank of a strategy's real code. Its collectives must complete at once without peers, and
what comes back must look like what the other ranks would send, or the strategies' own consistency checks
(DDP's parameter-shape verification, shardkit's same-model signatures) would refuse to start. Every peer is
taken to be a mirror of the planned rank: an all-gather fills each rank's slot with the local input, a
reduce-scatter keeps the local chunk, broadcasts and reductions leave the local buffer as it is. On meta tensors
nothing is copied at all (and nothing is allocated); on CPU the copies are those of a real run.

The group also keeps a :class:`TorchTraffic` ledger of every collective torch code issues on it (payload bytes per
kind), which sees what shardkit's comm meter cannot: torch DDP's bucket all-reduces.

Example::

    with peerless_world(world_size=64) as traffic:
        model = DistributedDataParallel(model)     # any strategy, unchanged
        ...
    print(traffic.payload_bytes)
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

from shardkit.plan._torch_private import create_work_from_future

BACKEND_NAME = "shardkit_peerless"

#: Op names as shardkit's comm meter writes them, so both ledgers line up.
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, REDUCE, SEND = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send",
)  # fmt: skip


@dataclass
class TorchTraffic:
    """Payload bytes and calls of the collectives issued on peerless groups, per op kind."""

    payload_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: Tensors handed to collectives, for the memory accountant (called with each buffer).
    on_buffer: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, kind: str, tensors: list[torch.Tensor]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        with self.lock:
            self.payload_bytes[kind] += nbytes
            self.calls[kind] += 1
        if self.on_buffer is not None:
            for tensor in tensors:
                self.on_buffer(tensor)

    def reset(self) -> None:
        with self.lock:
            self.payload_bytes.clear()
            self.calls.clear()


class Mailbox:
    """What planned ranks sent, for ranks planned after them (a pipeline's stages, planned one after another).

    A rank planned on its own cannot receive what its peers would send: its receives and the broadcasts it does
    not root would keep their own buffer (a mirror), which is wrong for messages only the sender knows (a
    pipeline's activation shapes). So every data-carrying message (CPU tensors; meta ones carry nothing) a planned
    rank sends or roots is kept here, in order per (source, destination or group); a rank planned later receives
    them in the same order. One mailbox spans the runs of one plan.
    """

    def __init__(self) -> None:
        self._messages: dict[tuple[Any, ...], list[torch.Tensor]] = defaultdict(list)
        self._read: dict[tuple[Any, ...], int] = defaultdict(int)

    def new_run(self) -> None:
        """A new rank is planned: it reads every message from the start."""
        self._read.clear()

    def post(self, key: tuple[Any, ...], tensor: torch.Tensor) -> None:
        if tensor.device.type != "meta":
            self._messages[key].append(tensor.detach().clone())

    def deliver(self, key: tuple[Any, ...], into: torch.Tensor) -> bool:
        """Copy the next message for ``key`` into ``into`` when there is one of its size (True); else leave it."""
        if into.device.type == "meta":
            return True
        queue, index = self._messages.get(key), self._read[key]
        if queue and index < len(queue):
            self._read[key] = index + 1
            if queue[index].numel() == into.numel():
                into.copy_(queue[index].view(into.shape))
                return True
        return False


_TRAFFIC: list[TorchTraffic] = []  # the ledger of the open peerless_world (at most one per process)
_MAIL: list[Mailbox] = []  # the mailbox of the open peerless_world


def _done(result: Any) -> Any:
    future: Future[Any] = Future()
    future.set_result(result)
    return create_work_from_future(future)


class _InFlight(dist.Work):
    """A point-to-point transfer of a planned gloo run: not completed until someone waits for it.

    On gloo, a send or receive runs on the backend's threads while the rank goes on computing; code that polls
    (``is_completed``) before waiting keeps its buffers until the transfer ends. The planner cannot know when a
    real peer would get there, so it plans the longest hold: a transfer ends when it is waited for. Every
    strategy waits for what it polls, so this never hangs.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._tensors = tensors
        self._finished = False

    def wait(self, timeout: Any = None) -> bool:
        self._finished = True
        return True

    def is_completed(self) -> bool:
        return self._finished

    def result(self) -> list[torch.Tensor]:
        return self._tensors


def _record(kind: str, tensors: list[torch.Tensor]) -> None:
    if _TRAFFIC:
        _TRAFFIC[-1].record(kind, tensors)


class PeerlessGroup(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose other members mirror this rank (see the module docstring)."""

    def __init__(self, rank: int, size: int, plans_backend: str = "nccl") -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the store-less constructor Python groups use
        self._rank = rank
        self._size = size
        #: The backend of the run being planned; strategies pick gloo's direct-send paths for meta tensors when it
        #: is ``"gloo"`` (:func:`shardkit.distributed.groups.planned_on_gloo`), so their receive buffers are counted.
        self.plans_backend = plans_backend

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # torch names every group it creates; a Python group keeps the name itself (destroying a subgroup reads it).
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return getattr(self, "_name", "")

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_desc", "")

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        _record(ALL_REDUCE, tensors)
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        for outs, local in zip(outputs, inputs):
            _record(ALL_GATHER, list(outs))
            for out in outs:
                out.copy_(local)
        return _done(outputs)

    def _allgather_base(self, output: torch.Tensor, local: torch.Tensor, opts: Any = None) -> Any:
        _record(ALL_GATHER, [output])
        output.view(self._size, -1).copy_(local.reshape(1, -1))
        return _done([output])

    def all_gather_single(self, output: torch.Tensor, local: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(output, local, opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        for output, local in zip(outputs, inputs):
            self._allgather_base(output, local, opts)
        return _done(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, full: torch.Tensor, opts: Any = None) -> Any:
        _record(REDUCE_SCATTER, [full])
        output.copy_(full.view(self._size, -1)[self._rank].view_as(output))
        return _done([output])

    def reduce_scatter_single(self, output: torch.Tensor, full: torch.Tensor, opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, full, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:  # type: ignore[override]
        for output, chunks in zip(outputs, inputs):
            _record(REDUCE_SCATTER, list(chunks))
            output.copy_(chunks[self._rank])
        return _done(outputs)

    def _global(self, group_rank: int) -> int:
        return int(dist.get_process_group_ranks(self)[group_rank])

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        _record(BROADCAST, tensors)
        root = int(getattr(opts, "rootRank", 0))
        if _MAIL:
            key = ("broadcast", tuple(dist.get_process_group_ranks(self)), root)
            for tensor in tensors:
                if root == self._rank:
                    _MAIL[-1].post(key, tensor)
                else:
                    _MAIL[-1].deliver(key, tensor)
        return _done(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        _record(REDUCE, tensors)
        return _done(tensors)

    def barrier(self, opts: Any = None) -> Any:
        return _done([])

    def _p2p_work(self, tensors: list[torch.Tensor]) -> Any:
        return _InFlight(tensors) if self.plans_backend == "gloo" else _done(tensors)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        _record(SEND, tensors)
        if _MAIL:
            for tensor in tensors:
                _MAIL[-1].post(("p2p", self._global(self._rank), self._global(dst), tag), tensor)
        return self._p2p_work(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        # What no planned rank sent (a mirrored peer's message, such as its gradient for a reduce by sends) reads
        # as ones, as meta data does, rather than whatever the buffer held.
        key = ("p2p", self._global(src), self._global(self._rank), tag)
        for tensor in tensors:
            if not (_MAIL and _MAIL[-1].deliver(key, tensor)) and tensor.device.type != "meta":
                tensor.fill_(1)
        return self._p2p_work(tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        return _done(tensors)

    def gather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        for outs, local in zip(outputs, inputs):
            for out in outs:
                out.copy_(local)
        return _done(outputs)

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        for output, chunks in zip(outputs, inputs):
            if chunks:
                output.copy_(chunks[self._rank])
        return _done(outputs)

    def alltoall_base(
        self, output: torch.Tensor, local: torch.Tensor, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> Any:
        output.copy_(local)
        return _done([output])


_PLANS: list[str] = []  # the planned backend of the open peerless_world, for every group created in it

#: Backends a plan can stand for: the accelerator's collectives, or gloo's CPU paths (direct sends).
PLANNED_BACKENDS = ("nccl", "gloo")


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> PeerlessGroup:
    return PeerlessGroup(rank, size, _PLANS[-1] if _PLANS else "nccl")


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "meta"])
        _registered = True


class _NoStore(dist.Store):
    """A key-value store that is never asked anything: no peer ever needs a rendezvous."""


@contextlib.contextmanager
def peerless_world(
    world_size: int, rank: int = 0, mailbox: Optional[Mailbox] = None, backend: str = "nccl"
) -> Iterator[TorchTraffic]:
    """Initialise the default process group as a peerless group of ``world_size`` ranks for the block.

    ``mailbox`` carries what earlier planned ranks sent (see :class:`Mailbox`). ``backend`` is the backend of the
    run being planned: ``"nccl"`` (accelerators: strategies issue collectives) or ``"gloo"`` (a CPU run: where
    strategies exchange CPU tensors by direct sends, they do so on meta tensors too, and the receive buffers those
    sends need are counted). The caller's process must not have
    a default group of its own (:func:`shardkit.plan.estimate` runs in a
    child process when it does). The group is destroyed when the block ends, whatever happens inside.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "shardkit.plan needs a process without a torch.distributed default group; estimate() runs itself in a "
            "child process when the caller has one"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"peerless_world needs world_size >= 1 and 0 <= rank < world_size, got {world_size}, {rank}")
    if backend not in PLANNED_BACKENDS:
        raise ValueError(f"peerless_world plans backend 'nccl' or 'gloo', got {backend!r}")
    _register()
    traffic = TorchTraffic()
    _TRAFFIC.append(traffic)
    mail = mailbox if mailbox is not None else Mailbox()
    mail.new_run()
    _MAIL.append(mail)
    _PLANS.append(backend)
    try:
        dist.init_process_group(BACKEND_NAME, store=_NoStore(), rank=rank, world_size=world_size)
        yield traffic
    finally:
        _TRAFFIC.remove(traffic)
        _MAIL.remove(mail)
        _PLANS.pop()
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["PLANNED_BACKENDS", "Mailbox", "PeerlessGroup", "TorchTraffic", "peerless_world"]
