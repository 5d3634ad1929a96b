"""shardkit bench plan --quick: the accuracy table runs and every row is within its bounds."""

from __future__ import annotations

import re

import pytest

from shardkit.bench import SUITES
from shardkit.bench.plan import run


def test_quick_accuracy_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert SUITES["plan"] == "shardkit.bench.plan"
    run(["--quick"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| demo LM |")]
    assert len(rows) == 7  # every strategy at world size 2, and FSDP with CPU offload
    assert any("| fsdp + cpu offload |" in row for row in rows)
    summary = re.search(r"largest peak error ([0-9.]+)%, largest state error ([0-9.]+)%, .*differ: (\d+)", out)
    assert summary is not None, out
    assert float(summary.group(1)) <= 10 and float(summary.group(2)) <= 10 and summary.group(3) == "0"
