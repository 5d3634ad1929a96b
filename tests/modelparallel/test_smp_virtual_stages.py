"""``"virtual_stages": v`` (chunks in loop placement, interleaved 1F1B on a tick grid) trains exactly as one process,
and bad settings are refused on every rank before the first step."""

from __future__ import annotations

import pytest
from test_smp_pipeline_parity import _check, _parity

from shardkit.modelparallel.virtual_schedules import (
    ChunkAction,
    bubble_fraction,
    interleaved_grid,
    interleaved_schedule,
)
from shardkit.testing import run_distributed

V2 = {"pipeline": "interleaved", "virtual_stages": 2}


def test_schedule_runs_every_action_once_in_dependency_order() -> None:
    for p, v, m in [(2, 2, 2), (2, 2, 8), (4, 2, 8), (2, 3, 4), (4, 3, 4)]:
        grid = interleaved_grid(p, v, m)
        seen: dict[tuple[str, int, int], int] = {}
        for t, row in enumerate(grid):
            for rank, action in enumerate(row):
                if action is not None:
                    assert action.chunk % p == rank
                    seen[(action.kind, action.chunk, action.microbatch)] = t
        assert len(seen) == 2 * p * v * m
        for (kind, c, k), t in seen.items():
            if kind == "F" and c > 0:
                assert seen[("F", c - 1, k)] < t
            if kind == "B":
                assert seen[("F", c, k)] < t
                if c < p * v - 1:
                    assert seen[("B", c + 1, k)] < t
    # The bubble of 1F1B, (p-1)/(m+p-1), divided by about v: (p-1)/(v*m+p-1) in ticks.
    assert bubble_fraction(interleaved_grid(2, 1, 8)) == pytest.approx(1 / 9)
    assert bubble_fraction(interleaved_grid(2, 2, 8)) == pytest.approx(1 / 17)


def test_rank_schedule_order() -> None:
    """Rounds of p micro-batches through each local chunk; backwards through the chunks in reverse."""
    assert interleaved_schedule(0, 2, 2, 2) == [
        ChunkAction("F", 0, 0),
        ChunkAction("F", 0, 1),
        ChunkAction("F", 2, 0),
        ChunkAction("F", 2, 1),
        ChunkAction("B", 2, 0),
        ChunkAction("B", 2, 1),
        ChunkAction("B", 0, 0),
        ChunkAction("B", 0, 1),
    ]


def test_two_ranks_two_chunks_match_single_process() -> None:
    cases = [
        ("mlp", {"partitions": 2, "microbatches": 4, **V2}, {}),
        ("mlp", {"partitions": 2, "microbatches": 2, **V2}, {}),
        # Cross-chunk residuals, one of them between the two chunks of rank 0; a glue parameter on every rank.
        ("residual", {"partitions": 2, "microbatches": 4, "auto_partition": False, **V2}, {"stages": 4}),
        ("lm", {"partitions": 2, "microbatches": 4, **V2}, {}),  # embedding tied to the head
    ]
    _check(run_distributed(_parity, 2, cases))
