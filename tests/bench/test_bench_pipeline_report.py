"""The pipeline bench's theory, cuts and report, without processes: bubbles from the formulas the schedules are
known by, torch's chunk placements, whose cut torch runs, and the ratios to torch's best schedule."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import pytest
import torch

from shardkit.bench import pipeline, pipeline_torch
from shardkit.bench.pipeline_report import Row, best_line, paired_ratio, print_report
from shardkit.bench.pipeline_smp import bubble_floor, predicted_bubble
from shardkit.bench.pipeline_theory import bubble_theory, torch_bubble_theory
from shardkit.bench.pipeline_torch import chunk_ranks, chunks_per_rank, even_cut, smp_cut
from shardkit.modelparallel.partitioning.auto_partition import Placement


def test_bubble_theory_formulas() -> None:
    assert bubble_theory("GPipe", 2, 8) == pytest.approx(1 / 9)  # (p-1)/(m+p-1)
    assert bubble_theory("1F1B", 4, 8) == pytest.approx(3 / 11)
    assert bubble_theory("interleaved", 4, 8, virtual_stages=2) == pytest.approx(3 / 19)  # (p-1)/(vm+p-1)
    assert bubble_theory("zero_bubble_h2", 2, 8) == pytest.approx(1 / 25)  # (p-1)/(3m+p-1)
    assert bubble_theory("dualpipev", 4, 8) == pytest.approx(3 / 51)  # (p-1)/(6m+p-1), from its tick grid
    assert pipeline.bubble_theory is bubble_theory  # re-exported where it used to live


def test_torch_schedules_map_onto_the_smp_schedule_of_their_shape() -> None:
    assert torch_bubble_theory("1F1B", 2, 8, 1) == pytest.approx(1 / 9)
    for looped in ("Interleaved1F1B", "LoopedBFS"):
        assert torch_bubble_theory(looped, 2, 8, 2) == pytest.approx(1 / 17)
    assert torch_bubble_theory("ZBVZeroBubble", 4, 8, 2) == pytest.approx(bubble_theory("zbv", 4, 8))
    assert torch_bubble_theory("DualPipeV", 4, 8, 2) == pytest.approx(bubble_theory("dualpipev", 4, 8))
    assert torch_bubble_theory("InterleavedZeroBubble", 2, 8, 2) is None  # no model: "-", not a made-up number


def test_chunk_placements() -> None:
    assert chunks_per_rank("single", 3) == 1 and chunks_per_rank("v", 3) == 2
    assert chunks_per_rank("loop", 1) == 2 and chunks_per_rank("loop", 3) == 3
    assert chunk_ranks("single", 4, 1) == (0, 1, 2, 3)
    assert chunk_ranks("loop", 2, 2) == (0, 1, 0, 1)
    assert chunk_ranks("v", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)  # both ends of the model on rank 0


def _placement(partitions: int, modules: tuple[tuple[str, int], ...]) -> Placement:
    costs = tuple(1.0 / partitions for _ in range(partitions))
    return Placement(partitions, modules, costs, costs, tuple(0 for _ in costs), 0.2, True)


def test_torch_takes_smp_cut_only_when_it_has_as_many_stages() -> None:
    modules = (("embed", 0), ("blocks.0", 0), ("blocks.1", 0), ("blocks.2", 0), ("blocks.3", 1), ("head", 1))
    placement = _placement(2, modules)
    assert smp_cut(4, 2, placement) == [range(0, 3), range(3, 4)]
    assert smp_cut(4, 4, placement) is None  # four chunks: smp's two stages are not its cut
    assert even_cut(4, 2) == [range(0, 2), range(2, 4)]
    head_alone = (("embed", 0), ("blocks.0", 0), ("blocks.1", 1), ("head", 2))  # as smp cuts 8 blocks in 8 chunks
    assert smp_cut(2, 3, _placement(3, head_alone)) == [range(0, 1), range(1, 2), range(2, 2)]
    empty_middle = (("embed", 0), ("blocks.0", 0), ("blocks.1", 0), ("head", 2))
    assert smp_cut(2, 3, _placement(3, empty_middle)) is None  # torch's middle stage would do nothing
    settings = replace(pipeline.PipelineSettings(), lm=replace(pipeline.QUICK_LM, n_layers=4))
    cuts = pipeline.torch_cuts(settings, {"single", "v"}, placement)
    assert cuts["single"][0] == [range(0, 3), range(3, 4)] and "the cut smp runs" in cuts["single"][1]
    assert cuts["v"][0] == even_cut(4, 4) and "DIFFERS from smp's cut" in cuts["v"][1]


def _row(name: str, schedule: str, median_ms: float, min_ms: float, diff: Optional[float] = None) -> Row:
    return Row(name, schedule, median_ms / 1e3, min_ms / 1e3, 4.0, diff, None, None)


def test_ratios_to_torch_best_and_our_best(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        _row("smp zero_bubble", "zero_bubble", 90, 80),
        _row("smp interleaved", "interleaved", 120, 70),
        _row("torch 1F1B", "1F1B", 150, 140, 0.0),
        _row("torch Interleaved1F1B", "Interleaved1F1B", 100, 100, 0.0),
    ]
    rows[3].chunks_per_rank, rows[3].bubble_theory = 2, 1 / 17
    assert best_line(rows) == (
        "our best vs torch's best: 0.90x (median step: smp zero_bubble 90 ms vs torch Interleaved1F1B 100 ms; "
        "min step: 0.70x, smp interleaved vs torch Interleaved1F1B)"
    )
    assert best_line(rows[2:]) is None  # smp did not run
    # with per-step times, the same steps' ratios too: drift between steps cancels (median of 0.8, 1.0, 0.9)
    rows[0].step_times_s, rows[3].step_times_s = [0.08, 0.30, 0.09], [0.10, 0.30, 0.10]
    line = best_line(rows)
    assert line is not None and line.endswith("; step by step, median of the same steps' ratios: 0.90x)")
    assert paired_ratio(rows[0], rows[3]) == pytest.approx(0.9) and paired_ratio(rows[1], rows[3]) is None
    rows[0].step_times_s = rows[3].step_times_s = None
    settings = pipeline.PipelineSettings(lm=pipeline.QUICK_LM, smp_schedules=("zero_bubble", "interleaved"))
    skipped = {"torch DualPipeV": "torch 2.8.0 has no ScheduleDualPipeV"}
    print_report(settings, rows, None, {"v": "4 stages (V placement): ..."}, skipped)
    out = capsys.readouterr().out
    cells = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in out.splitlines()
        if line.startswith(("| smp", "| torch"))
    }
    # schedule, median, vs 1F1B, vs best, min, vs 1F1B (min), vs best (min), bubble measured, theory, ...
    assert cells["smp zero_bubble"][2:7] == ["0.60x", "0.90x", "80", "0.57x", "0.80x"]
    assert (
        cells["torch Interleaved1F1B"][0] == "Interleaved1F1B x2 chunks" and cells["torch Interleaved1F1B"][8] == "5.9%"
    )
    assert cells["torch 1F1B"][3] == "1.50x"
    assert "our best vs torch's best: 0.90x" in out and "torch.pipelining v: 4 stages (V placement)" in out
    assert "torch DualPipeV: skipped (torch 2.8.0 has no ScheduleDualPipeV)" in out


def test_strategy_names_say_why_a_torch_schedule_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = pipeline.PipelineSettings(lm=pipeline.QUICK_LM)  # 2 blocks: too few for 4 chunks
    monkeypatch.setattr(pipeline_torch, "torch_schedule_class", lambda name: None if name == "torch GPipe" else object)
    monkeypatch.setattr(pipeline_torch, "v_schedules_run_on_gloo", lambda: True)  # the block count decides here
    names, skipped = pipeline.strategy_names(settings, "smp,torch all,torch 1F1B")
    assert names == ["smp", "torch 1F1B"]
    assert "has no torch.distributed.pipelining.ScheduleGPipe" in skipped["torch GPipe"]
    assert set(skipped) == {
        "torch GPipe",
        *(n for n in pipeline.TORCH_SCHEDULES if n not in ("torch GPipe", "torch 1F1B")),
    }
    assert "its 4 pipeline stages (2 per rank) need a block each; the LM has 2" in skipped["torch ZBVZeroBubble"]
    monkeypatch.setattr(pipeline_torch, "v_schedules_run_on_gloo", lambda: False)
    _, skipped = pipeline.strategy_names(settings, "smp,torch ZBVZeroBubble")
    assert "ScheduleZBVZeroBubble fails over gloo (runs from 2.13)" in skipped["torch ZBVZeroBubble"]


def test_no_schedule_idles_less_than_the_bubble_floor() -> None:
    """The floor is what the startup and the stages' unequal work leave idle whatever the order: with equal times
    at 2 stages it is ZB-H1's idle time, and every schedule's simulated bubble lies on or above it."""
    equal = [{"F": 1.0, "B": 1.0, "W": 1.0}] * 2
    assert bubble_floor(equal, 8) == pytest.approx(1 - 48 / 50)  # step >= F + 8 (F + B + W) = 25 units
    assert predicted_bubble("zero_bubble", equal, 8) == pytest.approx(bubble_floor(equal, 8))
    gen = torch.Generator().manual_seed(5)
    for p, m in [(2, 8), (3, 6), (4, 8)]:
        for _ in range(20):
            times = torch.rand(p, 3, generator=gen) + 0.1
            costs = [dict(zip("FBW", (float(t) for t in row))) for row in times]
            floor = bubble_floor(costs, m)
            for schedule in ("interleaved", "simple", "zero_bubble", "zero_bubble_h2"):
                assert predicted_bubble(schedule, costs, m) >= floor - 1e-12, (schedule, costs)
    # The bench LM's measured times at 2 x 8 (stage 0's input needs no gradient: its B is nearly free): 5.3%.
    measured = [{"F": 62.0, "B": 2.0, "W": 108.0}, {"F": 60.0, "B": 57.0, "W": 59.0}]
    assert bubble_floor(measured, 8) == pytest.approx(1 - 8 * (172 + 176) / (2 * (62 + 8 * 176)))
