"""Process topology: which global rank holds which pipeline stage (``mp_rank``) of which replica (``dp_rank``).

With ``placement_strategy="cluster"`` one replica's stages sit on neighbouring ranks (mp groups ``[0, 1], [2, 3]``
for 4 ranks and 2 partitions); with ``"spread"`` they are as far apart as possible (``[0, 2], [1, 3]``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """The rank arithmetic of one job; pure, so every rank computes the same answer without communicating.

    Example::

        topo = Topology(world_size=4, rank=3, mp_size=2, placement="cluster")
        assert (topo.mp_rank, topo.dp_rank) == (1, 1)
    """

    world_size: int
    rank: int
    mp_size: int
    placement: str = "cluster"

    def __post_init__(self) -> None:
        if self.world_size % self.mp_size:
            raise ValueError(
                f"smp needs the world size ({self.world_size}) to be a multiple of partitions ({self.mp_size}): "
                "launch partitions x replicas processes"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")

    @property
    def dp_size(self) -> int:
        """Number of model replicas."""
        return self.world_size // self.mp_size

    @property
    def mp_rank(self) -> int:
        """This process's pipeline stage."""
        return self.mp_rank_of(self.rank)

    @property
    def dp_rank(self) -> int:
        """This process's replica index."""
        return self.dp_rank_of(self.rank)

    def mp_rank_of(self, rank: int) -> int:
        """The pipeline stage held by global ``rank``."""
        return rank % self.mp_size if self.placement == "cluster" else rank // self.dp_size

    def dp_rank_of(self, rank: int) -> int:
        """The replica index of global ``rank``."""
        return rank // self.mp_size if self.placement == "cluster" else rank % self.dp_size

    def rank_of(self, mp_rank: int, dp_rank: int) -> int:
        """The global rank holding stage ``mp_rank`` of replica ``dp_rank``."""
        if self.placement == "cluster":
            return dp_rank * self.mp_size + mp_rank
        return mp_rank * self.dp_size + dp_rank

    def mp_group_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of replica ``dp_rank``, in stage order."""
        return [self.rank_of(s, dp_rank) for s in range(self.mp_size)]

    def dp_group_ranks(self, mp_rank: int) -> list[int]:
        """Global ranks holding stage ``mp_rank``, in replica order."""
        return [self.rank_of(mp_rank, d) for d in range(self.dp_size)]

    def stage_rank(self, mp_rank: int) -> int:
        """The global rank of stage ``mp_rank`` in this process's own replica (a point-to-point peer)."""
        return self.rank_of(mp_rank, self.dp_rank)
