"""The checkpoint benchmark in --quick mode: it runs, every rank reports its memory rises, and loads restore."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardkit.bench.checkpoint import run
from shardkit.bench.rss import PeakRSS


def test_quick_run_reports_every_rank(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "r.json"
    run(["--quick", "--world-size", "2", "--json", str(out), "--dir", str(tmp_path)])
    text = capsys.readouterr().out
    assert "fsdp rank 1" in text and "oss_sdp rank 1" in text and "load restores" in text
    assert "fsdp: shardkit checkpoint export of the model" in text
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2 and [r["strategy"] for r in ranks[0]] == ["fsdp", "oss_sdp"]
    for per_strategy in ranks:
        for r in per_strategy:
            assert r["loaded_equal"] is True
            assert r["owned_bytes"] > 0 and r["save_s"] > 0 and r["old_rise"] is not None
            assert r["async_stall_s"] is not None and r["async_rise"] is not None and r["async_total_s"] > 0
            assert (r["export_rise"] is not None) == (r["rank"] == 0)
    assert list(tmp_path.glob("shardkit-bench-ckpt-*")) == []  # checkpoints removed


def test_peak_rss_sees_a_temporary_allocation() -> None:
    import torch

    with PeakRSS() as peak:
        block = torch.ones(64 * 1024**2 // 4)  # 64 MiB, touched
        del block
    assert peak.rise >= 60 * 1024**2


def test_bad_options_exit_with_the_reason() -> None:
    with pytest.raises(SystemExit, match="strategies must be"):
        run(["--quick", "--strategies", "ddp"])
