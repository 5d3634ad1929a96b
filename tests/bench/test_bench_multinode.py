"""``shardkit bench multinode --quick``: two real elastic agents x two processes train every strategy; the same
batches give the same losses, and hybrid FSDP sends less than half of full sharding's bytes across nodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardkit.bench import SUITES, multinode


def test_quick_suite_runs_every_strategy_across_two_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert SUITES["multinode"] == "shardkit.bench.multinode"
    out = tmp_path / "multinode.json"
    multinode.run(["--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "2 torch elastic agents x 2 processes" in printed and "targets (fsdp_hybrid vs fsdp)" in printed
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted(multinode.STRATEGIES)
    assert all(row["error"] is None for row in rows.values()), rows
    # Every synchronous strategy trains the same model on the same global batches: the same loss.
    exact = [rows[name]["final_loss"] for name in ("ddp", "fsdp", "fsdp_hybrid", "oss_sdp", "oss_sdp_hybrid")]
    assert max(exact) - min(exact) < 1e-4, exact
    # Hybrid strategies keep most traffic inside the node.
    assert rows["fsdp_hybrid"]["inter_node_bytes"] <= 0.5 * rows["fsdp"]["inter_node_bytes"]
    assert rows["oss_sdp_hybrid"]["inter_node_bytes"] < rows["oss_sdp"]["inter_node_bytes"]
    assert all(row["slow_step_s"] > 0 and row["fast_step_s"] > 0 for row in rows.values())


def test_settings_refuse_unknown_strategies() -> None:
    with pytest.raises(ValueError, match="unknown multinode strategies"):
        multinode.MultinodeSettings(strategies=("ddp", "zero9"))
    with pytest.raises(SystemExit, match="unknown multinode strategies"):
        multinode.run(["--strategies", "nope"])
