"""shardkit bench plan-time --quick: the suite calibrates, predicts and measures every strategy.

Only the shape of the output and the sanity of its numbers are checked: how close predictions come is what the
benchmark reports, not something a test on a shared machine could assert.
"""

from __future__ import annotations

import math

import pytest

from shardkit.bench import SUITES
from shardkit.bench.plan_time import VARIANTS, kendall_tau, run


def _table(out: str, first_cell: str) -> list[list[str]]:
    rows = [line for line in out.splitlines() if line.startswith(f"| {first_cell} |")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_kendall_tau() -> None:
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3], [10, 30, 20]) == pytest.approx(1 / 3)


def test_quick_suite_prints_a_row_per_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    assert SUITES["plan-time"] == "shardkit.bench.plan_time"
    run(["--quick"])
    out = capsys.readouterr().out
    device = _table(out, "demo LM")[0]  # the device constants come first
    assert len(device) == 6 and all(float(cell) > 0 for cell in device[1:]), device
    link = _table(out, "2")
    assert len(link) == 1 and all(float(cell) > 0 for cell in link[0][1:]), link
    main = [row for row in _table(out, "demo LM") if len(row) == 8]
    assert [row[2] for row in main] == [variant.label for variant in VARIANTS]
    for row in main:
        assert row[1] == "2"
        numbers = [float(cell) for cell in row[3:7]]
        assert all(math.isfinite(x) and x > 0 for x in numbers), row
        predicted, measured, ratio = numbers[:3]
        assert ratio == pytest.approx(predicted / measured, rel=0.05, abs=0.01)
        assert float(row[7].rstrip("%")) >= 0  # the steps' spread
    ranking = [row for row in _table(out, "demo LM") if len(row) == 6 and row[4] in ("yes", "no")]
    assert len(ranking) == 1 and -1 <= float(ranking[0][5]) <= 1
    assert sorted(ranking[0][2].split(", ")) == sorted(ranking[0][3].split(", ")) == sorted(v.label for v in VARIANTS)
    relative = [row for row in _table(out, "demo LM") if len(row) == 5]
    assert [row[2] for row in relative] == [variant.label for variant in VARIANTS]
    assert relative[0][3:] == ["1.00", "1.00"]  # ddp against itself
    assert "largest ratio" in out and "smallest ratio" in out
