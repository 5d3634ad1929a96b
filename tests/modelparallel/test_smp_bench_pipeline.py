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
