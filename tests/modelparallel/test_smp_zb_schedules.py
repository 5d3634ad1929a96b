"""The zero-bubble action lists: each stage's micro-batch bound, deadlock freedom under any action times, and
the bubble they reach in simulation against 1F1B's."""

from __future__ import annotations

import random

import pytest
from smp_testlib import peak_held

from shardkit.modelparallel.pipeline.pipeline_parallel import (
    Action,
    one_f_one_b_schedule,
    schedule_for,
    split_backward_schedule,
    zero_bubble_h1_schedule,
)
from shardkit.modelparallel.schedules.zb_schedules import ZB_CAPS, build_schedules, simulate

SHAPES = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in (1, 2, 3, 4, 5, 8, 13, 16)]


@pytest.mark.parametrize("pipeline", ["zero_bubble", "zero_bubble_h2"])
@pytest.mark.parametrize("num_stages,microbatches", SHAPES)
def test_every_action_once_in_order_within_the_bound(pipeline: str, num_stages: int, microbatches: int) -> None:
    p = num_stages
    for stage in range(p):
        actions = schedule_for(pipeline, stage, p, microbatches)
        assert actions[0] == Action("F", 0)
        for kind in "FBW":
            assert [a.microbatch for a in actions if a.kind == kind] == list(range(microbatches))
        for k in range(microbatches):
            assert actions.index(Action("F", k)) < actions.index(Action("B", k)) < actions.index(Action("W", k))
        cap = ZB_CAPS[pipeline](stage, p)
        assert peak_held(actions) <= min(cap, microbatches)
        if pipeline == "zero_bubble":  # 1F1B's F/B order; W's postponed
            assert [a for a in actions if a.kind != "W"] == one_f_one_b_schedule(stage, p, microbatches)
            assert actions == zero_bubble_h1_schedule(stage, p, microbatches)


@pytest.mark.parametrize("pipeline", ["interleaved", "simple", "zero_bubble", "zero_bubble_h2"])
def test_no_deadlock_whatever_the_action_times(pipeline: str) -> None:
    """Every stage runs its list in order, blocking on what it receives; random per-stage F/B/W times
    (one stage 10x slower than another) never leave stages waiting on each other."""
    rng = random.Random(0)
    for p, m in SHAPES:
        schedules = [schedule_for(pipeline, s, p, m) for s in range(p)]
        for _ in range(3):
            costs = [{k: rng.uniform(0.1, 1.0) for k in "FBW"} for _ in range(p)]
            timeline = simulate(schedules, costs)
            assert all(len(run) == len(actions) for run, actions in zip(timeline.runs, schedules))


@pytest.mark.parametrize("pipeline", ["zero_bubble", "zero_bubble_h2"])
def test_written_lists_no_slower_than_the_greedy_simulation(pipeline: str) -> None:
    """For p in 2..8 and m from 1 to 3p+1: the phase lists run without deadlock, every stage holds at most its
    cap of micro-batches between F and W, and with unit action times the step is no longer than that of the
    lists the greedy simulation builds under the same caps."""
    for p in range(2, 9):
        caps = tuple(ZB_CAPS[pipeline](s, p) for s in range(p))
        for m in range(1, 3 * p + 2):
            written = [schedule_for(pipeline, s, p, m) for s in range(p)]
            assert all(peak_held(actions) <= cap for actions, cap in zip(written, caps))
            greedy = build_schedules(p, m, caps)
            assert simulate(written).makespan <= simulate(greedy).makespan, (p, m)


def test_more_warmup_downstream_deadlocks() -> None:
    """The condition the written lists meet (no stage runs more forwards before its first backward than the stage
    before it) is needed: a second stage waiting for three forwards before B0 while the first waits for B0's
    gradient after two never gets going."""
    bad = [split_backward_schedule(4, 2, 0), split_backward_schedule(4, 3, 0)]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad)
    simulate([split_backward_schedule(4, 3, 0), split_backward_schedule(4, 3, 0)])


def test_crossed_lists_are_reported_as_a_deadlock() -> None:
    """The checker itself: two stages each receiving first what the other sends only later."""
    bad = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)], [Action("F", 1), Action("F", 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad)


@pytest.mark.parametrize("num_stages,microbatches", [(2, 8), (4, 8), (4, 16), (8, 16), (3, 5)])
def test_simulated_bubbles_against_one_f_one_b(num_stages: int, microbatches: int) -> None:
    """Equal F, B and W times. 1F1B: (p-1)(F+B+W) idle per stage, (p-1)/(m+p-1) of the step. ZB-H2 and ZB-H1 at
    the paper's bound (every stage holding up to p micro-batches): (p-1)F, the least any schedule can have (the
    last stage's wait for the first activation), about 0.4x 1F1B's fraction. ZB-H1 by default (holding up to
    max(2, p-1)): (p-1)F at 2 stages, pF from 3."""
    p, m = num_stages, microbatches

    def bubble(pipeline: str) -> float:
        return simulate([schedule_for(pipeline, s, p, m) for s in range(p)]).mean_bubble()

    paper_h1 = simulate([zero_bubble_h1_schedule(s, p, m, hold=p) for s in range(p)]).mean_bubble()
    default_idle = p - 1 if p == 2 else p
    assert bubble("interleaved") == pytest.approx((p - 1) / (m + p - 1))
    assert bubble("zero_bubble") == pytest.approx(default_idle / (3 * m + default_idle))
    assert bubble("zero_bubble_h2") == pytest.approx((p - 1) / (3 * m + p - 1)) == pytest.approx(paper_h1)
    assert paper_h1 <= 0.42 * bubble("interleaved")


@pytest.mark.parametrize("num_stages", [2, 3, 4, 8])
def test_h1_hold_trades_memory_for_bubble(num_stages: int) -> None:
    """ZB-H1 with every stage holding up to ``hold`` micro-batches: each more held on the later stages takes
    one F off every stage's idle time, from 2(p-1)F at 1F1B's memory (hold=1) to (p-1)F at hold=p."""
    p, m = num_stages, 2 * num_stages + 1
    for hold in range(1, p + 1):
        written = [zero_bubble_h1_schedule(s, p, m, hold) for s in range(p)]
        assert [peak_held(actions) for actions in written] == [max(p - s, hold) for s in range(p)]
        assert simulate(written).makespan == 3 * m + 2 * p - 1 - hold
