"""``shardkit bench 3d``'s plumbing without processes: the layouts it compares, how the ranks' measurements combine
(the slowest rank per step, the rank with the highest peak) beside the plan, and the table it prints."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardkit.bench import SUITES
from shardkit.bench.three_d import combine, layouts_for, parse_args, report, settings_from_args
from shardkit.bench.three_d_measure import LayoutRun, ThreeDSettings
from shardkit.plan import Estimate
from shardkit.plan.layouts import Layout
from shardkit.plan.measure import RealRank


def test_the_3d_layout_is_compared_with_pipeline_x_data_at_the_same_world_size() -> None:
    assert SUITES["3d"] == "shardkit.bench.three_d"
    assert layouts_for(8, is_quick=False) == [
        Layout(2, 2, 2), Layout(2, 2, 2, prescaled=True), Layout(2, 1, 4), Layout(4, 1, 2)
    ]  # fmt: skip
    assert layouts_for(4, is_quick=True) == [Layout(2, 2, 1), Layout(2, 1, 2)]
    with pytest.raises(SystemExit, match="multiple of 4"):
        layouts_for(6, is_quick=False)
    with pytest.raises(SystemExit, match="--steps must be at least 1"):
        settings_from_args(parse_args(["--steps", "0"]))
    s = ThreeDSettings()
    work = s.workload(Layout(2, 2, 2))  # one replica feeds 2 ranks' sequences, cut into 4 micro-batches
    assert (work.kind, work.batch_size, work.strategy_options["microbatches"]) == ("smp_lm", 2 * s.batch, 4)
    assert work.strategy_options["tensor_parallel_degree"] == 2
    shared = s.workload(Layout(2, 2, 2, prescaled=True))  # a tensor pair shares one batch: twice as many sequences
    assert (shared.batch_size, shared.strategy_options["prescaled_batch"]) == (4 * s.batch, True)


def _estimate(peak: int, state: int, sent: int) -> Estimate:
    return Estimate("smp", 4, "meta", peak, state, {}, "backward", "", {}, {"send": sent}, {}, None, {}, 0.0, {}, 0.0)


def _run(label: str, times: list[float], peak: int) -> LayoutRun:
    return LayoutRun(label, times, RealRank(peak, peak // 2, {"send": peak // 4, "all_reduce": 1}, {}))


def test_ranks_combine_into_the_slowest_step_and_the_highest_peak_beside_the_plan() -> None:
    per_rank = [  # two ranks, two layouts each
        [_run("pp2 x tp2 x dp1", [0.10, 0.30, 0.20], 400), _run("pp2 x tp1 x dp2", [0.20, 0.20, 0.20], 800)],
        [_run("pp2 x tp2 x dp1", [0.40, 0.10, 0.10], 600), _run("pp2 x tp1 x dp2", [0.30, 0.10, 0.50], 700)],
    ]
    planned = [_estimate(660, 300, 150), _estimate(840, 400, 200)]
    three_d, two_d = combine(per_rank, planned)
    assert three_d.label == "pp2 x tp2 x dp1" and three_d.median_s == pytest.approx(0.30)  # median of .4, .3, .2
    assert two_d.median_s == pytest.approx(0.30)  # median of .3, .2, .5
    assert (three_d.measured_peak, three_d.measured_state, three_d.measured_sent) == (600, 300, 151)
    assert (three_d.planned_peak, three_d.planned_state, three_d.planned_sent) == (660, 300, 150)
    text = report([three_d, replace(two_d, median_s=0.6)], ThreeDSettings(), 4)
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
             if line.startswith("| pp")}  # fmt: skip
    assert "vs pp2 x tp1 x dp2" in text.splitlines()[2]
    assert cells["pp2 x tp2 x dp1"][1:3] == ["300.0", "0.50x"]  # 3-D step time over pipeline x data
    assert cells["pp2 x tp2 x dp1"][5] == "1.10x"  # planned peak 660 over measured 600
    assert cells["pp2 x tp1 x dp2"][2] == "1.00x"
