"""One rank layout for every parallelism: data (replicas), pipeline, context and tensor, tensor varying fastest.

The world's ranks are numbered as a ``(data, pipeline, context, tensor)`` grid in row-major order, so the ranks of
one tensor-parallel group are consecutive (they share a node and its fast links) and a data-parallel group takes
one rank from each replica. This is the order fairscale's ``initialize_model_parallel`` and smp's default placement
use. The layout is pure arithmetic: every rank computes the same answer, so a bad layout raises the same error on
every rank before any group is created.

Example::

    layout = ParallelLayout.for_world(8, tensor=2, pipeline=2)   # data = 2
    layout.coords(5)                   # ParallelCoords(data=1, pipeline=0, context=0, tensor=1)
    layout.group_ranks("tensor", 5)    # [4, 5]
    layout.group_ranks("data", 5)      # [1, 5]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

#: The layout's dimensions, slowest first; also the names of the device mesh's dimensions.
DIMS = ("data", "pipeline", "context", "tensor")


class ParallelCoords(NamedTuple):
    """Where one rank sits in the grid: its rank inside each kind of group."""

    data: int
    pipeline: int
    context: int
    tensor: int


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending (the degrees that split ``n`` evenly)."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of the four dimensions; their product is the world size."""

    data: int
    pipeline: int = 1
    context: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        bad = {name: size for name, size in zip(DIMS, self.shape) if not isinstance(size, int) or size < 1}
        if bad:
            raise ValueError(f"ParallelLayout: every size must be a positive int, got {bad}")

    @classmethod
    def for_world(cls, world_size: int, tensor: int = 1, pipeline: int = 1, context: int = 1) -> ParallelLayout:
        """The layout of ``world_size`` ranks with the given degrees; the data-parallel degree is what remains.

        Raises ``ValueError`` when ``tensor * pipeline * context`` does not divide ``world_size``, naming the
        tensor-parallel degrees that would.
        """
        model = tensor * pipeline * context
        if min(tensor, pipeline, context) < 1 or world_size % model:
            fitting = [t for t in divisors(world_size) if (world_size // t) % (pipeline * context) == 0]
            raise ValueError(
                f"world size {world_size} is not data x pipeline x context x tensor: tensor {tensor} x pipeline "
                f"{pipeline} x context {context} = {model} does not divide it. With pipeline {pipeline} and context "
                f"{context}, tensor-parallel sizes that fit are {fitting or 'none'}; or start {model} x N processes."
            )
        return cls(data=world_size // model, pipeline=pipeline, context=context, tensor=tensor)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(data, pipeline, context, tensor)``: the device mesh's shape."""
        return (self.data, self.pipeline, self.context, self.tensor)

    @property
    def world_size(self) -> int:
        """Ranks the layout covers."""
        return self.data * self.pipeline * self.context * self.tensor

    def coords(self, rank: int) -> ParallelCoords:
        """The position of global ``rank`` in the grid (tensor fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} ranks")
        sizes = self.shape
        place = []
        for size in reversed(sizes):
            place.append(rank % size)
            rank //= size
        return ParallelCoords(*reversed(place))

    def rank_of(self, coords: ParallelCoords) -> int:
        """The global rank at ``coords`` (the inverse of :meth:`coords`)."""
        rank = 0
        for index, size in zip(coords, self.shape):
            rank = rank * size + index
        return rank

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group along ``dim`` (one of :data:`DIMS`), in group-rank order."""
        axis = DIMS.index(dim)
        here = list(self.coords(rank))
        ranks = []
        for index in range(self.shape[axis]):
            here[axis] = index
            ranks.append(self.rank_of(ParallelCoords(*here)))
        return ranks

    def grid(self) -> list[list[list[list[int]]]]:
        """The global ranks as a nested list of :attr:`shape` (what ``DeviceMesh`` takes)."""
        ranks = iter(range(self.world_size))
        return [
            [[[next(ranks) for _ in range(self.tensor)] for _ in range(self.context)] for _ in range(self.pipeline)]
            for _ in range(self.data)
        ]
