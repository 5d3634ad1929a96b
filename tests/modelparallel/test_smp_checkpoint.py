"""Checkpoints: partial save -> load -> identical continued training; full save -> plain torch model and back."""

from __future__ import annotations

from typing import Any

from smp_testlib import checkpoint_round_trips

from shardkit.testing import run_distributed


def test_partial_and_full_checkpoints(tmp_path: Any) -> None:
    for r in run_distributed(checkpoint_round_trips, 2, str(tmp_path)):
        assert r["files"] == ["full.pt", "partial.pt_0", "partial.pt_1"]
        assert r["held"] < r["total"]  # a partial checkpoint holds one stage's share
        for key in ("partial", "full", "plain"):
            assert r[f"{key}_loss_diff"] <= 1e-6, (key, r)
            assert r[f"{key}_out_diff"] <= 1e-6, (key, r)
        assert r["partial_param_diff"] <= 1e-6 and r["full_param_diff"] <= 1e-6, r
