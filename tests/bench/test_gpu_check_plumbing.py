"""``make gpu-check`` on a machine without CUDA: says so, runs its plumbing, writes its JSON and exits 0; a part
that fails or runs past its limit is recorded without stopping the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardkit.bench.gpu_check.__main__ import PARTS, PartRun, merge, run_part


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a machine without CUDA does")
def test_dry_run_without_cuda(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    cmd = [sys.executable, "-m", "shardkit.bench.gpu_check", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA device here" in proc.stdout
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["dry_run"] is True and doc["cuda"] is False and doc["failed"] == []
    assert set(doc["parts"]) == {name for name, _, _ in PARTS}
    assert doc["parts"]["env"]["rc"] == 0 and doc["parts"]["env"]["checks"]["private_torch_apis"]["ok"]
    assert all(doc["parts"][name] == {"skipped": "no CUDA (dry run)"} for name, _, _ in PARTS if name != "env")
    assert "=== env rc=0" in (tmp_path / "gpu_check.log").read_text()


def test_a_part_past_its_limit_is_killed_and_recorded(tmp_path: Path) -> None:
    log_path = tmp_path / "log"
    with log_path.open("w") as f:
        slow = run_part("slow", 1, tmp_path, False, f, [sys.executable, "-c", "import time; time.sleep(60)"])
        bad = run_part("bad", 30, tmp_path, False, f, [sys.executable, "-c", "raise SystemExit(3)"])
    assert slow.timed_out and slow.secs < 30 and bad.rc == 3 and not bad.timed_out
    (tmp_path / "part_bad.json").write_text(json.dumps({"checks": {"x": {"ok": False, "error": "E"}}}))
    doc = merge(tmp_path, [slow, bad, PartRun("good", 0, 1.0, False)], {"skipped_one": "why"}, {"cuda": True})
    assert doc["failed"] == ["slow:<process rc=-9 timed out>", "bad:x", "bad:<process rc=3>"]
    assert doc["parts"]["good"]["ok"] and doc["parts"]["skipped_one"] == {"skipped": "why"}
