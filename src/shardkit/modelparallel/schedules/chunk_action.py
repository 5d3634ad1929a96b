"""The unit of every schedule over chunks (:mod:`~shardkit.modelparallel.schedules.virtual_schedules`,
:mod:`~shardkit.modelparallel.schedules.zbv`, :mod:`~shardkit.modelparallel.schedules.dualpipev`) and the builder
the V schedules write their phases with, kept apart so that each schedule's file can build its lists without
importing the others."""

from __future__ import annotations

from typing import NamedTuple, Optional


class ChunkAction(NamedTuple):
    """One unit of a rank's virtual-stage schedule: ``kind`` ``"F"``, ``"B"`` or ``"W"`` of ``chunk`` on
    ``microbatch``."""

    kind: str
    chunk: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.chunk}"


class RankList:
    """One rank's list as a schedule's phases write it: the next micro-batch of every (kind, chunk), and the W's
    that split backwards left for later (oldest first)."""

    def __init__(self) -> None:
        self.actions: list[ChunkAction] = []
        self._next: dict[tuple[str, int], int] = {}
        self._deferred: list[ChunkAction] = []

    def _take(self, kind: str, chunk: int) -> ChunkAction:
        k = self._next.get((kind, chunk), 0)
        self._next[(kind, chunk)] = k + 1
        return ChunkAction(kind, chunk, k)

    def taken(self, kind: str, chunk: int) -> int:
        """How many ``kind`` actions of ``chunk`` the list has so far."""
        return self._next.get((kind, chunk), 0)

    def forward(self, chunk: int) -> None:
        self.actions.append(self._take("F", chunk))

    def backward(self, chunk: int, defer_weight: bool = False) -> None:
        """B of ``chunk``'s next micro-batch; its W right after (a whole backward) unless ``defer_weight``."""
        b = self._take("B", chunk)
        self.actions.append(b)
        weight = ChunkAction("W", chunk, b.microbatch)
        if defer_weight:
            self._deferred.append(weight)
        else:
            self.actions.append(weight)

    def pair(self, forward: int, backward: int) -> None:
        """One micro-batch's forward on one chunk with another's whole backward on the other: what DualPipeV
        overlaps (computation of one with communication of the other); here they run back to back."""
        self.forward(forward)
        self.backward(backward)

    def deferred_weight(self, chunk: Optional[int] = None) -> None:
        """The oldest postponed W (of ``chunk``, if given)."""
        at = next(i for i, w in enumerate(self._deferred) if chunk is None or w.chunk == chunk)
        self.actions.append(self._deferred.pop(at))

    def deferred(self, chunk: int) -> int:
        """How many W's of ``chunk`` are still postponed."""
        return sum(w.chunk == chunk for w in self._deferred)
