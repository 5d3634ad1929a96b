"""Process topology: smp's rank kinds on the tensor-parallel core's one rank layout.

smp places ``rdp x pp x tp`` ranks (reduced data, pipeline, tensor) in the order its ``placement_strategy`` names,
slowest first: ``"cluster"`` is ``"DPT"`` (one replica's stages and tensor-parallel ranks on neighbouring ranks:
mp groups ``[0, 1], [2, 3]`` for 4 ranks and 2 partitions), ``"spread"`` is ``"TPD"`` (as far apart as possible:
``[0, 2], [1, 3]``), and any permutation of the three letters works. The arithmetic is the core's
:class:`~shardkit.tensor_parallel.ParallelLayout` (data = reduced data parallelism), so smp, the tensor-parallel
layers and the device mesh agree on every rank.

The pipeline engine reads this class with two indices per rank: ``mp_rank`` is its **pipeline stage** (smp's
``pp_rank``) and ``dp_rank`` its index among the ranks holding the same stage (smp's data-parallel group, which
includes the tensor-parallel ranks: ``dp_rank = rdp_rank * tp_size + tp_rank``). Without tensor parallelism these
are smp's ``mp_rank`` and ``dp_rank``; with it, smp's model-parallel rank is :attr:`smp_mp_rank` (pipeline x tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardkit.tensor_parallel.layout import ParallelCoords, ParallelLayout

#: smp's placement letters as the core layout's dimensions.
LETTER_DIMS = {"D": "data", "P": "pipeline", "T": "tensor"}


def placement_dims(order: str) -> tuple[str, ...]:
    """A ``"DPT"``-style order as the layout's dimensions, slowest first (context, of size one, beside tensor)."""
    dims: list[str] = []
    for letter in order:
        dims += ["context", "tensor"] if letter == "T" else [LETTER_DIMS[letter]]
    return tuple(dims)


_ORDERS = {"cluster": "DPT", "spread": "TPD"}


@dataclass(frozen=True)
class Topology:
    """The rank arithmetic of one job; pure, so every rank computes the same answer without communicating.

    Example::

        topo = Topology(world_size=4, rank=3, mp_size=2, placement="cluster")
        assert (topo.mp_rank, topo.dp_rank) == (1, 1)
        topo = Topology(world_size=8, rank=5, mp_size=2, placement="DPT", tp_size=2)
        assert (topo.rdp_rank, topo.mp_rank, topo.tp_rank) == (1, 0, 1)
    """

    world_size: int
    rank: int
    #: The pipeline degree (``partitions``).
    mp_size: int
    #: ``"cluster"``, ``"spread"`` or a permutation of ``"DPT"``.
    placement: str = "cluster"
    #: The tensor-parallel degree.
    tp_size: int = 1
    layout: ParallelLayout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        model = self.mp_size * self.tp_size
        if self.world_size % model and self.tp_size == 1:
            raise ValueError(
                f"smp needs the world size ({self.world_size}) to be a multiple of partitions ({self.mp_size}): "
                "launch partitions x replicas processes"
            )
        if self.world_size % model:
            raise ValueError(
                f"smp needs the world size ({self.world_size}) to be a multiple of pipeline_parallel_degree "
                f"({self.mp_size}) x tensor_parallel_degree ({self.tp_size}) = {model}: launch {model} x replicas "
                "processes"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        order = _ORDERS.get(self.placement, self.placement)
        layout = ParallelLayout.for_world(
            self.world_size, tensor=self.tp_size, pipeline=self.mp_size, order=placement_dims(order)
        )
        object.__setattr__(self, "layout", layout)

    @property
    def rdp_size(self) -> int:
        """Ranks holding the same stage and the same tensor-parallel slice (reduced data parallelism)."""
        return self.layout.data

    @property
    def dp_size(self) -> int:
        """smp's data-parallel degree: ranks holding the same stage (``rdp_size * tp_size``)."""
        return self.world_size // self.mp_size

    @property
    def coords(self) -> ParallelCoords:
        """This process's place in the layout."""
        return self.layout.coords(self.rank)

    @property
    def mp_rank(self) -> int:
        """This process's pipeline stage."""
        return self.coords.pipeline

    @property
    def tp_rank(self) -> int:
        """This process's rank in its tensor-parallel group."""
        return self.coords.tensor

    @property
    def rdp_rank(self) -> int:
        """This process's rank in its reduced-data-parallel group."""
        return self.coords.data

    @property
    def dp_rank(self) -> int:
        """This process's index among the ranks of its stage (smp's ``dp_rank``)."""
        return self.dp_rank_of(self.rank)

    @property
    def smp_mp_rank(self) -> int:
        """smp's ``mp_rank``: the rank in the model-parallel group (pipeline x tensor), ``pp_rank * tp + tp_rank``."""
        return self.mp_rank * self.tp_size + self.tp_rank

    def mp_rank_of(self, rank: int) -> int:
        """The pipeline stage held by global ``rank``."""
        return self.layout.coords(rank).pipeline

    def dp_rank_of(self, rank: int) -> int:
        """The index of global ``rank`` among the ranks of its stage."""
        coords = self.layout.coords(rank)
        return coords.data * self.tp_size + coords.tensor

    def rank_of(self, mp_rank: int, dp_rank: int) -> int:
        """The global rank holding stage ``mp_rank`` at index ``dp_rank`` among that stage's ranks."""
        rdp, tp = divmod(dp_rank, self.tp_size)
        return self.layout.rank_of(ParallelCoords(rdp, mp_rank, 0, tp))

    def mp_group_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of the pipeline through index ``dp_rank``, in stage order."""
        return [self.rank_of(s, dp_rank) for s in range(self.mp_size)]

    def dp_group_ranks(self, mp_rank: int) -> list[int]:
        """Global ranks holding stage ``mp_rank``, in ``dp_rank`` order."""
        return [self.rank_of(mp_rank, d) for d in range(self.dp_size)]

    def stage_rank(self, mp_rank: int) -> int:
        """The global rank of stage ``mp_rank`` in this process's own pipeline (a point-to-point peer)."""
        return self.rank_of(mp_rank, self.dp_rank)

    def group_ranks(self, dim: str) -> list[int]:
        """This process's group along a layout dimension (``"tensor"``, ``"data"`` = reduced data, ``"pipeline"``)."""
        return self.layout.group_ranks(dim, self.rank)

    def smp_mp_group_ranks(self) -> list[int]:
        """smp's model-parallel group: the ranks holding this process's model replica, in ``smp_mp_rank`` order."""
        here = self.coords
        return [
            self.layout.rank_of(ParallelCoords(here.data, p, 0, t))
            for p in range(self.mp_size)
            for t in range(self.tp_size)
        ]
