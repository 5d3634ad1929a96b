"""A fake point-to-point transport with NCCL's blocking rule, in one process, for the pipeline's deadlock tests.

Each rank runs what it posted in order, one group at a time (one stream); a send completes only while the peer's
matching receive is running, and the operations of one group run together. A rank whose next group can never run
raises :class:`Deadlock` instead of hanging. Threads play the ranks; ``batches=False`` posts each message as its own
group (what a transport that cannot batch would do).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardkit.modelparallel.pipeline.pp_communications import Message


class Deadlock(RuntimeError):
    pass


@dataclass(eq=False)
class _Op:
    kind: str  # "send" or "recv"
    pair: tuple[int, int]  # (src, dst)
    seq: int  # n-th message between the pair
    tensor: torch.Tensor
    done: bool = False


@dataclass(eq=False)
class _Group:
    ops: list[_Op] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(op.done for op in self.ops)


class RendezvousWorld:
    """Blocking-send point-to-point between threads; a deadlock is every live rank waiting with no progress."""

    def __init__(self, ranks: int) -> None:
        self.cv = threading.Condition()
        self.streams: dict[int, list[_Group]] = {r: [] for r in range(ranks)}
        self.counts: dict[tuple[str, int, int], int] = defaultdict(int)
        self.live = ranks
        self.waiting: list[_Group] = []

    def post(self, rank: int, sends: Sequence[Message], recvs: Sequence[Message], batches: bool) -> list[_Handle]:
        with self.cv:
            ops = [self._op("recv", (m.peer, rank), m.tensor) for m in recvs]
            ops += [self._op("send", (rank, m.peer), m.tensor) for m in sends]
            groups = [_Group(ops)] if batches else [_Group([op]) for op in ops]
            self.streams[rank] += groups
            self._progress()
            self.cv.notify_all()
            return [_Handle(self, g) for g in groups]

    def _op(self, kind: str, pair: tuple[int, int], tensor: torch.Tensor) -> _Op:
        key = (kind, *pair)
        seq = self.counts[key]
        self.counts[key] += 1
        return _Op(kind, pair, seq, tensor)

    def _head(self, rank: int) -> _Group | None:
        return next((g for g in self.streams[rank] if not g.done), None)

    def _progress(self) -> None:
        moved = True
        while moved:
            moved = False
            for rank in self.streams:
                head = self._head(rank)
                for op in head.ops if head else []:
                    if op.done:
                        continue
                    peer = op.pair[1] if op.kind == "send" else op.pair[0]
                    other = self._head(peer)
                    match = [
                        o
                        for o in (other.ops if other else [])
                        if not o.done and o.kind != op.kind and o.pair == op.pair and o.seq == op.seq
                    ]
                    if match:
                        send, recv = (op, match[0]) if op.kind == "send" else (match[0], op)
                        recv.tensor.copy_(send.tensor)
                        op.done = match[0].done = moved = True

    def finished(self) -> None:
        with self.cv:
            self.live -= 1
            self.cv.notify_all()

    def wait(self, group: _Group) -> None:
        with self.cv:
            self.waiting.append(group)
            try:
                while not group.done:
                    if len(self.waiting) == self.live and not any(g.done for g in self.waiting):
                        self.cv.notify_all()  # wake the others so they see it too
                        raise Deadlock("every rank waits on a send or receive that cannot run")
                    self.cv.wait(timeout=30)
            finally:
                self.waiting.remove(group)


class _Handle:
    def __init__(self, world: RendezvousWorld, group: _Group) -> None:
        self.world, self.group = world, group

    def wait(self) -> None:
        self.world.wait(self.group)

    def is_completed(self) -> bool:
        return self.group.done


class FakeTransport:
    def __init__(self, world: RendezvousWorld, rank: int, batches: bool) -> None:
        self.world, self.rank, self.batches = world, rank, batches

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> list[_Handle]:
        return self.world.post(self.rank, sends, recvs, self.batches)
