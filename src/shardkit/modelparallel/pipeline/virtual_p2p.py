"""Messages between chunks (virtual stages): named, and posted one group per tick of the schedule.

A message is named by :data:`Key`; a chunk's sends and receives name only the other chunk, and the running
action supplies the rest. Messages between two chunks of one rank never leave it. Why one group per tick makes
the exchange deadlock-free on a transport whose sends block (NCCL) is said in
:mod:`~shardkit.modelparallel.pipeline.virtual_stages`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch

from shardkit.distributed import collectives as C
from shardkit.modelparallel.pipeline.pp_communications import Message, P2PTransport, StageLink
from shardkit.modelparallel.schedules.virtual_schedules import ChunkAction
from shardkit.modelparallel.topology import Topology

#: (direction "F"/"B", source chunk, destination chunk, micro-batch, sequence number between the two chunks).
Key = tuple[str, int, int, int, int]


class Expected(NamedTuple):
    """A message a neighbour produces at this tick for one of this rank's chunks."""

    key: Key
    shape: tuple[int, ...]
    dtype: torch.dtype
    src_rank: int


class _Batch:
    """The handles of one tick's group, waited on once by whichever receive needs it first."""

    def __init__(self, handles: list[C.Handle]) -> None:
        self.handles: Optional[list[C.Handle]] = handles

    def wait(self) -> None:
        if self.handles is not None:
            for handle in self.handles:
                handle.wait()
            self.handles = None


class ChunkLink(StageLink):
    """Messages between chunks, named by :data:`Key`; remote ones go out in :meth:`exchange`, one group a tick.

    The runtime's sends and receives name only the other chunk; the running ``action`` (set by the executor)
    supplies the direction, this chunk and the micro-batch.
    """

    def __init__(
        self,
        group: Any,
        topology: Topology,
        mp_group: Any,
        chunk_ranks: tuple[int, ...],
        transport: Optional[P2PTransport] = None,
    ) -> None:
        super().__init__(group, topology, mp_group, transport)
        self.chunk_ranks = chunk_ranks
        self.rank = topology.mp_rank
        self.action: Optional[ChunkAction] = None
        # Sent and received messages are numbered apart: a message between two chunks of this rank is both.
        self._seq: dict[tuple[bool, str, int, int, int], int] = {}
        self._loopback: dict[Key, torch.Tensor] = {}
        self._outgoing: list[tuple[Key, Message]] = []
        self._inbox: dict[Key, tuple[torch.Tensor, _Batch]] = {}

    def _key(self, src: int, dst: int, sending: bool) -> Key:
        assert self.action is not None, "a chunk message outside a scheduled action"
        kind, mb = self.action.kind, self.action.microbatch
        n = self._seq.get((sending, kind, src, dst, mb), 0)
        self._seq[(sending, kind, src, dst, mb)] = n + 1
        return (kind, src, dst, mb, n)

    def send(self, tensor: torch.Tensor, dst_stage: int, label: str, private: bool = False) -> None:
        """Queue ``tensor`` for chunk ``dst_stage`` (kept here when that chunk is on this rank)."""
        assert self.action is not None
        payload = tensor.detach()
        if not private or not payload.is_contiguous():
            payload = payload.clone(memory_format=torch.contiguous_format)
        key = self._key(self.action.chunk, dst_stage, sending=True)
        dst_rank = self.chunk_ranks[dst_stage]
        if dst_rank == self.rank:
            self._loopback[key] = payload
            return
        self.sent_bytes += payload.numel() * payload.element_size()
        self._outgoing.append((key, Message(payload, self.topology.stage_rank(dst_rank), label)))

    def recv_many(
        self, specs: Sequence[tuple[tuple[int, ...], torch.dtype, int]], device: torch.device, label: str
    ) -> list[torch.Tensor]:
        """The tensors chunk ``src`` sent to the running chunk, one per ``(shape, dtype, src)``, in order."""
        assert self.action is not None
        out = []
        for shape, dtype, src in specs:
            key = self._key(src, self.action.chunk, sending=False)
            if key in self._loopback:
                tensor = self._loopback.pop(key)
            elif key in self._inbox:
                tensor, batch = self._inbox.pop(key)
                start = time.perf_counter()
                batch.wait()
                self.wait_s += time.perf_counter() - start
            else:
                raise RuntimeError(f"virtual stages: message {key} was never scheduled to arrive here (a schedule bug)")
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise RuntimeError(
                    f"virtual stages: message {key} has shape {tuple(tensor.shape)} {tensor.dtype}, expected {shape} "
                    f"{dtype}: every micro-batch of a step must call the model with the same shapes"
                )
            out.append(tensor)
        return out

    def exchange(self, expected: Sequence[Expected], device: torch.device) -> None:
        """End of a tick: post this tick's sends and the receives of ``expected`` as one group."""
        sends = [m for _, m in sorted(self._outgoing, key=lambda item: item[0])]
        self._outgoing = []
        ordered = sorted(expected, key=lambda e: e.key)
        buffers = [torch.empty(e.shape, dtype=e.dtype, device=device) for e in ordered]
        recvs = [Message(b, self.topology.stage_rank(e.src_rank), "vstage:recv") for b, e in zip(buffers, ordered)]
        if not sends and not recvs:
            return
        batch = _Batch(self.transport.post(sends, recvs))
        for e, buffer in zip(ordered, buffers):
            self._inbox[e.key] = (buffer, batch)
        if sends:
            self._pending.append((_BatchHandle(batch), [m.tensor for m in sends]))
            if len(self._pending) > 64:
                self._reap()

    def begin(self) -> None:
        """A new step: message numbers restart; nothing may be left over from the last one."""
        if self._loopback or self._inbox or self._outgoing:
            raise RuntimeError("virtual stages: messages of the previous step were never consumed (a schedule bug)")
        self._seq = {}


class _BatchHandle(C.Handle):
    """A :class:`_Batch` as one handle (for the sends' bookkeeping in :class:`StageLink`)."""

    def __init__(self, batch: _Batch) -> None:
        super().__init__()
        self._batch = batch

    def wait(self) -> None:
        self._batch.wait()

    def is_completed(self) -> bool:
        handles = self._batch.handles
        return handles is None or all(h.is_completed() for h in handles)
