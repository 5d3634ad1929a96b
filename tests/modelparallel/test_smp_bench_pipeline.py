"""The pipeline benchmark program runs (tiny settings) and its three strategies train identically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardkit.bench import pipeline


def test_quick_pipeline_suite_agrees_with_torch_pipelining(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "pipeline.json"
    pipeline.run(["--quick", "--json", str(out_json)])
    out = capfd.readouterr().out
    assert "torch 1F1B" in out and "bubble theory" in out and "smp placement" in out
    rows = {row["name"]: row for row in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"smp", "torch GPipe", "torch 1F1B"}
    for name in ("torch GPipe", "torch 1F1B"):
        assert rows[name]["max_loss_diff_vs_smp"] <= 1e-5, rows[name]  # same weights, data and maths
    assert 0.0 <= rows["smp"]["bubble_measured"] < 1.0 and len(rows["smp"]["bubble_per_stage"]) == 2
    assert all(row["median_step_s"] > 0 for row in rows.values())


def test_schedules_side_by_side_train_identically(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """--schedules runs smp's 1F1B and ZB-H1 in the same processes, each from the same weights: the same losses
    (the split backward's gradients are bit-identical), a bubble and peak activation memory per stage each."""
    out_json = tmp_path / "schedules.json"
    pipeline.run(["--quick", "--strategies", "smp", "--schedules", "interleaved,zero_bubble", "--json", str(out_json)])
    out = capfd.readouterr().out
    assert "smp zero_bubble vs smp interleaved: bubble" in out
    rows = {row["name"]: row for row in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"smp interleaved", "smp zero_bubble"}
    assert rows["smp zero_bubble"]["max_loss_diff_vs_smp"] == 0.0
    for row in rows.values():
        assert len(row["bubble_per_stage"]) == 2 and len(row["peak_activation_mib"]) == 2
        assert all(mib > 0 for mib in row["peak_activation_mib"])
    # ZB-H1 holds each micro-batch until its W: never less than 1F1B on a stage, at most all of GPipe's.
    for stage in range(2):
        assert (
            rows["smp zero_bubble"]["peak_activation_mib"][stage]
            >= rows["smp interleaved"]["peak_activation_mib"][stage]
        )


@pytest.mark.parametrize("chunking", [["--virtual-stages", "2"], ["--smp-pipeline", "zbv"]])
def test_chunked_schedules_train_as_torch_1f1b(
    chunking: list[str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Virtual stages and ZBV run in the suite, beside torch's 1F1B on the same batches: the same losses."""
    out_json = tmp_path / "chunked.json"
    pipeline.run(["--quick", "--strategies", "smp,torch 1F1B", *chunking, "--json", str(out_json)])
    out = capfd.readouterr().out
    assert "smp placement (auto, 4 stages" in out  # four chunks for two stages
    rows = {row["name"]: row for row in json.loads(out_json.read_text())["rows"]}
    assert rows["torch 1F1B"]["max_loss_diff_vs_smp"] <= 1e-5, rows
    assert 0.0 <= rows["smp"]["bubble_measured"] < 1.0 and len(rows["smp"]["peak_activation_mib"]) == 2


def test_chunked_schedule_runs_alone() -> None:
    with pytest.raises(SystemExit):
        pipeline.run(["--quick", "--virtual-stages", "2", "--schedules", "interleaved,zero_bubble"])
