"""The unit of every schedule over chunks (:mod:`~shardkit.modelparallel.virtual_schedules`,
:mod:`~shardkit.modelparallel.dualpipev`), kept apart so that each schedule's file can build its lists without
importing the others."""

from __future__ import annotations

from typing import NamedTuple


class ChunkAction(NamedTuple):
    """One unit of a rank's virtual-stage schedule: ``kind`` ``"F"``, ``"B"`` or ``"W"`` of ``chunk`` on
    ``microbatch``."""

    kind: str
    chunk: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.chunk}"
