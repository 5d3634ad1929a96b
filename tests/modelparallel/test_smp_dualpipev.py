"""``"pipeline": "dualpipev"``: its per-rank lists on the tick grid ZBV's executor runs (no deadlock, every action
once in a valid order, DualPipeV's activation bound, its bubble against ZBV's), and its order against torch's."""

from __future__ import annotations

from typing import Optional

import pytest
from smp_testlib import peak_held
from torch.distributed.pipelining import schedules as torch_schedules

import shardkit.modelparallel as smp
from shardkit.modelparallel.schedules.dualpipev import dualpipev_schedule, dualpipev_schedules
from shardkit.modelparallel.schedules.virtual_schedules import (
    ChunkAction,
    bubble_fraction,
    fused_backwards,
    placement,
    schedule_grid,
    tick_grid,
)
from shardkit.modelparallel.schedules.zbv import zbv_schedule

SHAPES = [(p, m) for p in range(2, 7) for m in range(2 * p, 4 * p + 1)]


def _check_order(actions: list[ChunkAction], rank: int, p: int, m: int) -> None:
    """Every F, B and W of the rank's two chunks once; per chunk, micro-batches in order and F before B before W."""
    down, up = rank, 2 * p - 1 - rank
    assert sorted(actions) == sorted(ChunkAction(k, c, mb) for k in "FBW" for c in (down, up) for mb in range(m))
    where = {a: i for i, a in enumerate(actions)}
    for c in (down, up):
        for kind in "FB":
            assert [a.microbatch for a in actions if a.kind == kind and a.chunk == c] == list(range(m))
        for k in range(m):
            assert where[ChunkAction("F", c, k)] < where[ChunkAction("B", c, k)] < where[ChunkAction("W", c, k)]
    # rank p-1 holds both chunks of the V's bottom: its own forward (backward) feeds the other chunk's
    if rank == p - 1:
        for k in range(m):
            assert where[ChunkAction("F", p - 1, k)] < where[ChunkAction("F", p, k)]
            assert where[ChunkAction("B", p, k)] < where[ChunkAction("B", p - 1, k)]


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_lists_run_on_the_tick_grid_within_dualpipev_bounds(p: int, m: int) -> None:
    """p in 2..6, m from 2p to 4p: no deadlock, every action once in dependency order, at most 2p + 1
    chunk-micro-batches held per rank (DeepSeek's PP + 1 for PP = 2p stages, one more than ZBV's 2p), and a
    bubble of exactly p - 1 idle ticks per rank, never above ZBV's."""
    lists = dualpipev_schedules(p, m)
    grid = tick_grid(lists, p, 2 * p)  # raises if the lists wait on each other in a cycle
    ran: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(grid):
        for rank, a in enumerate(row):
            if a is not None:
                assert placement("dualpipev", p, 2)[a.chunk] == rank
                ran[(a.kind, a.chunk, a.microbatch)] = t
    assert len(ran) == 3 * 2 * p * m
    for (kind, c, k), t in ran.items():
        if kind == "F" and c > 0:
            assert ran[("F", c - 1, k)] < t
        if kind == "B" and c < 2 * p - 1:
            assert ran[("B", c + 1, k)] < t
    zbv_grid = schedule_grid("zbv", p, 2, m)
    for rank, actions in enumerate(lists):
        _check_order(actions, rank, p, m)
        assert peak_held(actions) == 2 * p + 1
        _check_order(zbv_schedule(rank, p, m), rank, p, m)  # ZBV's lists, on the same V
        zbv_actions = [row[rank] for row in zbv_grid if row[rank] is not None]
        assert peak_held([a for a in zbv_actions if a is not None]) <= 2 * p
        # the docstring's timeline: r idle ticks before the first forward, none until the last forward, and the
        # other p - 1 - r where a B of the down chunk waits for its gradient
        idle = [t for t, row in enumerate(grid) if row[rank] is None]
        last_forward = max(t for t, row in enumerate(grid) if (a := row[rank]) is not None and a.kind == "F")
        assert len(idle) == p - 1 and idle[:rank] == list(range(rank))
        for t in idle[rank:]:
            waiting = next(a for row in grid[t:] if (a := row[rank]) is not None)
            assert t > last_forward and waiting.kind == "B" and waiting.chunk == rank, (rank, t, waiting)
    assert grid == schedule_grid("dualpipev", p, 2, m)
    assert len(grid) == 6 * m + p - 1
    assert bubble_fraction(grid) == pytest.approx((p - 1) / (6 * m + p - 1))
    assert bubble_fraction(grid) <= bubble_fraction(zbv_grid) + 1e-12


def test_wider_sweep_runs_with_the_same_bubble() -> None:
    """Beyond the shapes checked in full: up to 10 ranks and 6p + 3 micro-batches, the grid exists (no cycle) and
    every rank idles exactly p - 1 ticks, under DualPipeV and under ZBV."""
    for p in range(2, 11):
        for m in range(2 * p, 6 * p + 4):
            for pipeline in ("dualpipev", "zbv"):
                grid = schedule_grid(pipeline, p, 2, m)
                assert len(grid) == 6 * m + p - 1, (pipeline, p, m)
                assert all(sum(row[r] is None for row in grid) == p - 1 for r in range(p)), (pipeline, p, m)


def test_phases_of_one_rank() -> None:
    """Rank 1 of 3 (chunks 1 and 4), 7 micro-batches: the warm-up, the paired steady state and the cool-down."""
    actions = dualpipev_schedule(1, 3, 7)

    def run(text: str) -> list[ChunkAction]:
        return [ChunkAction(a[0], int(a[1:].split("@")[1]), int(a[1:].split("@")[0])) for a in text.split()]

    warmup = run("F0@1 F1@1 F2@1 F0@4 F3@1 F1@4 B0@4 W0@4 F2@4")
    steady = run("F4@1 B1@4 W1@4 F3@4 B0@1 W0@1 F5@1 B2@4 W2@4 F4@4 B1@1 W1@1 F6@1 B3@4 W3@4 F5@4 B2@1 W2@1")
    cooldown = run("B4@4 W4@4 F6@4 B3@1 W3@1 B5@4 W5@4 B4@1 W4@1 B6@4 B5@1 W6@4 B6@1 W5@1 W6@1")
    assert actions == warmup + steady + cooldown


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 9), (6, 20)])
def test_same_order_as_torch_dualpipev(p: int, m: int) -> None:
    """torch's ScheduleDualPipeV lists (its overlapped pair flattened to forward then backward, a full backward to
    B then W) are ours: the bench's theory for torch's DualPipeV is smp's."""
    cls = getattr(torch_schedules, "ScheduleDualPipeV", None)
    if cls is None:
        pytest.skip("this torch has no ScheduleDualPipeV")
    kinds = torch_schedules._ComputationType

    def flat(action: torch_schedules._Action) -> list[ChunkAction]:
        kind = action.computation_type
        if kind == kinds.OVERLAP_F_B:
            return [a for sub in action.sub_actions or () for a in flat(sub)]
        stage, mb = action.stage_index, action.microbatch_index
        assert mb is not None
        if kind == kinds.FULL_BACKWARD:
            return [ChunkAction("B", stage, mb), ChunkAction("W", stage, mb)]
        names = {kinds.FORWARD: "F", kinds.BACKWARD_INPUT: "B", kinds.BACKWARD_WEIGHT: "W"}
        return [ChunkAction(names[kind], stage, mb)]

    class _Shape:  # what the list builder reads of a schedule object
        pp_group_size = p
        _n_microbatches = m

    for rank in range(p):
        ops: list[Optional[torch_schedules._Action]] = cls._calculate_single_rank_operations(_Shape(), rank)
        theirs = [a for op in ops if op is not None for a in flat(op)]
        assert theirs == dualpipev_schedule(rank, p, m), rank


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"microbatches": 3}, r"pipeline='dualpipev' needs at least 2 x partitions = 4 micro-batches"),
        ({"virtual_stages": 3}, r"pipeline='dualpipev' places exactly two chunks per rank"),
        ({"partitions": 1}, r"pipeline='dualpipev' needs partitions >= 2"),
    ],
)
def test_bad_config_is_refused(extra: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        smp.ModelParallelConfig.from_dict({"partitions": 2, "microbatches": 4, "pipeline": "dualpipev", **extra})
    cfg = smp.ModelParallelConfig.from_dict({"partitions": 3, "microbatches": 6, "pipeline": "dualpipev"})
    assert cfg.chunks == 6


def _ends_with_fusion(grid: list[list[Optional[ChunkAction]]], p: int) -> dict[ChunkAction, int]:
    """When each action ends if every rank runs its fused pairs (``fused_backwards``) as one two-tick backward at
    B's place and skips their W: an event replay of the grid's order with its dependencies."""
    num_chunks = 2 * p
    fused = [fused_backwards(grid, r) for r in range(p)]
    lists = [[row[r] for row in grid if row[r] is not None] for r in range(p)]
    end: dict[ChunkAction, int] = {}
    free = [0] * p
    position = [0] * p
    while any(position[r] < len(lists[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(lists[r]):
                a = lists[r][position[r]]
                whole = (a.chunk, a.microbatch) in fused[r]
                if a.kind == "W" and whole:
                    end[a] = end[ChunkAction("B", a.chunk, a.microbatch)]
                    position[r] += 1
                    continue
                if a.kind == "F":
                    need = ChunkAction("F", a.chunk - 1, a.microbatch) if a.chunk > 0 else None
                elif a.kind == "B":
                    need = ChunkAction("B", a.chunk + 1, a.microbatch) if a.chunk < num_chunks - 1 else None
                else:
                    need = ChunkAction("B", a.chunk, a.microbatch)
                if need is not None and need not in end:
                    break
                start = max(free[r], end[need] if need is not None else 0)
                end[a] = free[r] = start + (2 if a.kind == "B" and whole else 1)
                position[r] += 1
                progressed = True
        assert progressed or all(position[r] == len(lists[r]) for r in range(p)), "replay stuck"
    return end


@pytest.mark.parametrize("pipeline", ["dualpipev", "zbv"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (3, 6), (4, 8), (4, 12), (6, 12)])
def test_running_b_and_w_whole_delays_no_action(pipeline: str, p: int, m: int) -> None:
    grid = schedule_grid(pipeline, p, 2, m)
    ticks = {a: t for t, row in enumerate(grid) for a in row if a is not None}
    end = _ends_with_fusion(grid, p)
    fused = [fused_backwards(grid, r) for r in range(p)]
    due = dict(ticks)  # a fused B's work is done by its W's tick
    for r in range(p):
        for c, k in fused[r]:
            due[ChunkAction("B", c, k)] = ticks[ChunkAction("W", c, k)]
    late = {a: (end[a], t + 1) for a, t in due.items() if end[a] > t + 1}
    assert not late, f"fused backwards delay {late}"
    if pipeline == "dualpipev":  # its paired steps run W right after B: most pairs fuse
        assert all(len(f) >= m // 2 for f in fused)


def test_b_is_not_run_with_its_w_when_its_gradient_is_needed_at_once() -> None:
    b, w = ChunkAction("B", 1, 0), ChunkAction("W", 1, 0)
    upstream = ChunkAction("B", 0, 0)
    soon = [[None, b], [upstream, w]]  # rank 0 takes the gradient in the tick rank 1 would spend on W
    later = [[None, b], [None, w], [upstream, None]]
    assert fused_backwards(soon, 1) == set()
    assert fused_backwards(later, 1) == {(1, 0)}
    assert fused_backwards([[None, b], [None, None], [None, w]], 1) == set()  # W deferred into another tick: kept
