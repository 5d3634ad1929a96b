"""shardkit bench pipeline with torch.distributed.pipelining's multi-stage schedules beside smp's (tiny LM): every
schedule trains the same model from the same weights on the same batches, so every loss agrees with smp's, and
the table gives each schedule's ratio to torch's best of the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardkit.bench import pipeline
from shardkit.bench.pipeline_torch import TORCH_SCHEDULES, torch_schedule_class
from shardkit.utils.report import ratio
from shardkit.utils.torch_compat import v_schedules_run_on_gloo


def _rows(path: Path) -> dict[str, dict]:
    return {row["name"]: row for row in json.loads(path.read_text())["rows"]}


def test_every_torch_schedule_trains_as_smp_at_two_stages(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "two.json"
    # four blocks: the multi-stage schedules cut the LM into four chunks, one block each
    pipeline.run(["--quick", "--layers", "4", "--strategies", "smp,torch all", "--json", str(out_json)])
    out = capfd.readouterr().out
    rows = _rows(out_json)
    zbv_runs = v_schedules_run_on_gloo()
    for name in TORCH_SCHEDULES:  # what this torch lacks is named, with the reason, instead of a row
        v_layout = TORCH_SCHEDULES[name].layout == "v"
        runs_here = torch_schedule_class(name) is not None and (not v_layout or zbv_runs)
        assert (name in rows) == runs_here, name
        assert (name in rows) != (f"{name}: skipped (torch " in out), name
    assert {"torch GPipe", "torch 1F1B", "torch Interleaved1F1B"} <= set(rows)
    assert ("torch ZBVZeroBubble" in rows) == zbv_runs
    for name, row in rows.items():
        if name != "smp":
            assert row["max_loss_diff_vs_smp"] <= 1e-5, row  # same weights, data and maths
    assert rows["torch Interleaved1F1B"]["chunks_per_rank"] == 2 and rows["torch Interleaved1F1B"]["bubble_theory"] > 0
    assert "vs torch best" in out
    if zbv_runs:
        assert "torch.pipelining v: 4 stages (V placement)" in out
    torch_rows = [row for name, row in rows.items() if name.startswith("torch ")]
    best = min(row["median_step_s"] for row in torch_rows)
    assert f"our best vs torch's best: {ratio(rows['smp']['median_step_s'], best)} (median step: smp " in out


def test_four_stages_run_the_multi_stage_schedules(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "four.json"
    torch_names = ["torch 1F1B", "torch Interleaved1F1B"]
    torch_names += ["torch ZBVZeroBubble"] if v_schedules_run_on_gloo() else []
    argv = ["--quick", "--stages", "4", "--layers", "8", "--steps", "1", "--warmup", "0"]
    pipeline.run([*argv, "--strategies", ",".join(["smp", *torch_names]), "--json", str(out_json)])
    out = capfd.readouterr().out
    rows = _rows(out_json)
    assert set(rows) == {"smp", *torch_names}
    for name in torch_names:
        assert rows[name]["max_loss_diff_vs_smp"] <= 1e-5, rows[name]
    assert "torch.pipelining loop: 8 stages (loop placement)" in out and "our best vs torch's best: " in out
