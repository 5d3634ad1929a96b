"""One rank layout for every parallelism: data (replicas), pipeline, context and tensor, tensor varying fastest.

The world's ranks are numbered as a ``(data, pipeline, context, tensor)`` grid in row-major order, so the ranks of
one tensor-parallel group are consecutive (they share a node and its fast links) and a data-parallel group takes
one rank from each replica. This is the order fairscale's ``initialize_model_parallel`` and smp's default placement
use; ``order`` names another (smp's ``placement_strategy`` permutations, e.g. tensor slowest and data fastest). The
mesh's dimensions keep the names and order of :data:`DIMS` whatever the rank order. The layout is pure arithmetic:
every rank computes the same answer, so a bad layout raises the same error on every rank before any group is created.

Example::

    layout = ParallelLayout.for_world(8, tensor=2, pipeline=2)   # data = 2
    layout.coords(5)                   # ParallelCoords(data=1, pipeline=0, context=0, tensor=1)
    layout.group_ranks("tensor", 5)    # [4, 5]
    layout.group_ranks("data", 5)      # [1, 5]
    spread = ParallelLayout.for_world(8, tensor=2, pipeline=2, order=("tensor", "pipeline", "context", "data"))
    spread.group_ranks("tensor", 0)    # [0, 4]: data varies fastest
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
    """The sizes of the four dimensions; their product is the world size. ``order`` lists the dimensions slowest
    first in global rank order (default :data:`DIMS`: tensor fastest)."""

    data: int
    pipeline: int = 1
    context: int = 1
    tensor: int = 1
    order: tuple[str, ...] = DIMS

    def __post_init__(self) -> None:
        bad = {name: size for name, size in zip(DIMS, self.shape) if not isinstance(size, int) or size < 1}
        if bad:
            raise ValueError(f"ParallelLayout: every size must be a positive int, got {bad}")
        if sorted(self.order) != sorted(DIMS):
            raise ValueError(f"ParallelLayout: order must be a permutation of {list(DIMS)}, got {self.order!r}")

    @classmethod
    def for_world(
        cls, world_size: int, tensor: int = 1, pipeline: int = 1, context: int = 1, order: tuple[str, ...] = DIMS
    ) -> ParallelLayout:
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
        return cls(data=world_size // model, pipeline=pipeline, context=context, tensor=tensor, order=tuple(order))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(data, pipeline, context, tensor)``: the device mesh's shape."""
        return (self.data, self.pipeline, self.context, self.tensor)

    @property
    def world_size(self) -> int:
        """Ranks the layout covers."""
        return self.data * self.pipeline * self.context * self.tensor

    def coords(self, rank: int) -> ParallelCoords:
        """The position of global ``rank`` in the grid (the last dimension of :attr:`order` fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} ranks")
        sizes = dict(zip(DIMS, self.shape))
        place = {}
        for dim in reversed(self.order):
            place[dim] = rank % sizes[dim]
            rank //= sizes[dim]
        return ParallelCoords(*(place[dim] for dim in DIMS))

    def rank_of(self, coords: ParallelCoords) -> int:
        """The global rank at ``coords`` (the inverse of :meth:`coords`)."""
        sizes, index = dict(zip(DIMS, self.shape)), dict(zip(DIMS, coords))
        rank = 0
        for dim in self.order:
            rank = rank * sizes[dim] + index[dim]
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
        """The global ranks as a nested list of :attr:`shape`, indexed by coordinates (what ``DeviceMesh`` takes)."""
        return [
            [
                [[self.rank_of(ParallelCoords(d, p, c, t)) for t in range(self.tensor)] for c in range(self.context)]
                for p in range(self.pipeline)
            ]
            for d in range(self.data)
        ]
