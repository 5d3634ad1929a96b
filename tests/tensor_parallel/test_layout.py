"""ParallelLayout's rank order: the default (tensor fastest) and a permuted ``order`` (smp's placement strategies)
agree with their own coordinates, groups and device-mesh grid."""

from __future__ import annotations

import itertools

import pytest

from shardkit.tensor_parallel import DIMS, ParallelCoords, ParallelLayout


@pytest.mark.parametrize(
    "order", [DIMS, ("tensor", "context", "pipeline", "data"), ("pipeline", "tensor", "context", "data")]
)
def test_every_order_is_a_bijection_with_a_matching_grid(order: tuple[str, ...]) -> None:
    layout = ParallelLayout.for_world(8, tensor=2, pipeline=2, order=order)
    coords = [layout.coords(rank) for rank in range(8)]
    assert sorted(coords) == sorted(ParallelCoords(*c) for c in itertools.product(range(2), range(2), [0], range(2)))
    assert all(layout.rank_of(c) == rank for rank, c in enumerate(coords))
    grid = layout.grid()
    assert all(grid[c.data][c.pipeline][c.context][c.tensor] == rank for rank, c in enumerate(coords))
    fastest = order[-1] if order[-1] != "context" else order[-2]
    assert layout.group_ranks(fastest, 0) == [0, 1]  # the last dimension of ``order`` is consecutive ranks


def test_default_order_is_tensor_fastest_and_bad_orders_are_refused() -> None:
    layout = ParallelLayout.for_world(8, tensor=2, pipeline=2)
    assert layout.coords(5) == ParallelCoords(data=1, pipeline=0, context=0, tensor=1)
    assert layout.group_ranks("data", 5) == [1, 5]
    with pytest.raises(ValueError, match="order must be a permutation"):
        ParallelLayout(2, order=("data", "tensor"))
