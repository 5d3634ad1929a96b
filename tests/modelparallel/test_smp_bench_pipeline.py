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
    """--schedules runs smp's 1F1B, ZB-H1 and ZB-H2 in the same processes, each from the same weights: the same
    losses (the split backward's gradients are bit-identical), a bubble (measured, and predicted from the measured
    F/B/W times) and peak activation memory per stage each."""
    out_json = tmp_path / "schedules.json"
    schedules = "interleaved,zero_bubble,zero_bubble_h2"
    pipeline.run(["--quick", "--strategies", "smp", "--schedules", schedules, "--json", str(out_json)])
    out = capfd.readouterr().out
    assert "smp zero_bubble vs smp interleaved: bubble" in out and "bubble of its lists with these times" in out
    rows = {row["name"]: row for row in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"smp interleaved", "smp zero_bubble", "smp zero_bubble_h2"}
    for name in ("smp zero_bubble", "smp zero_bubble_h2"):
        assert rows[name]["max_loss_diff_vs_smp"] == 0.0
        assert all(ms["W"] > 0 for ms in rows[name]["action_ms"])
    assert all(ms["W"] == 0 and ms["B"] > 0 for ms in rows["smp interleaved"]["action_ms"])
    for row in rows.values():
        assert len(row["bubble_per_stage"]) == 2 and len(row["peak_activation_mib"]) == 2
        assert all(mib > 0 for mib in row["peak_activation_mib"]) and 0 <= row["bubble_predicted"] < 1
    memory = {name: row["peak_activation_mib"] for name, row in rows.items()}
    # ZB-H1's later stages hold up to p micro-batches as the first does under 1F1B, less each once B has run
    assert max(memory["smp zero_bubble"]) <= 1.05 * max(memory["smp interleaved"])
    assert memory["smp zero_bubble"][0] <= 1.05 * memory["smp interleaved"][0]  # the first stage postpones none
    for stage in range(2):
        assert rows["smp zero_bubble"]["peak_with_w_grads_mib"][stage] >= memory["smp zero_bubble"][stage]
    assert memory["smp zero_bubble_h2"][0] > memory["smp zero_bubble"][0]  # ZB-H2 holds more on the first stage


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
    assert all(mib > 0 for mib in rows["smp"]["peak_activation_mib"])  # the chunks' forwards are measured too


def test_chunked_schedule_runs_alone() -> None:
    with pytest.raises(SystemExit):
        pipeline.run(["--quick", "--virtual-stages", "2", "--schedules", "interleaved,zero_bubble"])
    # DualPipeV cuts its own V of chunks as ZBV does (its run: test_smp_dualpipev's parity, the bench by hand)
    assert pipeline.PipelineSettings(smp_pipeline="dualpipev").smp_chunked
    with pytest.raises(SystemExit):
        pipeline.run(["--quick", "--schedules", "interleaved,dualpipev"])
