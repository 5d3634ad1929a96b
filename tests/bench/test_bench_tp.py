"""``shardkit bench tp`` at toy size: both tables with every variant, shardkit's and torch's TP sending exactly the
formula's bytes from the same weights (the same first loss), and each rank holding half the split layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardkit.bench import SUITES
from shardkit.bench.tp import QUICK, formula_bytes, run, unsplit_params


@pytest.mark.multi
def test_quick_tp_suite_prints_both_tables_and_bytes_equal_the_formula(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert SUITES["tp"] == "shardkit.bench.tp"
    out = tmp_path / "tp.json"
    run(["--quick", "--world-size", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    columns = ["ms/step", "vs torch TP", "MiB sent/step", "formula MiB", "= formula", "peak MiB/rank", "vs FSDP"]
    assert all(f" {column} |" in printed for column in columns), printed
    for row in ("| shardkit TP", "| torch TP", "| FSDP x2", "| TP 2 x FSDP 1"):
        assert row in printed, printed
    assert "targets: shardkit TP step" in printed and "(met; torch TP" in printed
    results = json.loads(out.read_text())["results"]
    ours, theirs = results["tp"]
    assert ours["wire_bytes"] == theirs["wire_bytes"] == formula_bytes(QUICK) > 0
    assert ours["split_params"] == theirs["split_params"] == unsplit_params(QUICK) // 2
    assert ours["first_loss"] == pytest.approx(theirs["first_loss"], abs=1e-5)
    assert all(len(m["step_s"]) == QUICK.steps and m["peak_bytes"] > 0 for part in results.values() for m in part)
