"""``make gpu-check``'s plumbing on CPU: two output files whatever happens, a verdict for every check, a part
killed at its limit keeps its records and its stack dump and leaves no process behind, a run that expects a GPU
and finds no CUDA fails, and the two-rank form that two GPUs would take (faked) records its checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkit.bench.gpu_check.report import Summary
from shardkit.bench.gpu_check.results import FAIL, NOT_RUN, PASS, VERDICTS, Results
from shardkit.bench.gpu_check.runner import PartRun
from shardkit.bench.gpu_check.settings import FAKE_GPUS_ENV, PARTS, Part, expect_gpu, inner_timeout_s, rank_form

SRC = Path(__file__).resolve().parents[2] / "src"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split()[2] == "Z")  # a zombie is dead, not yet reaped


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One dry run on CPU that expects a GPU, with every part chosen and the hanging self-test part at 8 s."""
    if torch.cuda.is_available():
        pytest.skip("the dry run is what a machine without CUDA does")
    out = tmp_path_factory.mktemp("gpu_check_out")
    parts = ",".join([p.name for p in PARTS] + ["selftest_hang"])
    cmd = [sys.executable, "-m", "shardkit.bench.gpu_check", "--out", str(out), "--dry-run", "--expect-gpu",
           "--parts", parts, "--limit", "selftest_hang=8"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=out)
    return proc, out


def test_dry_run_writes_two_files_and_a_verdict_for_every_check(dry_run: Any) -> None:
    proc, out = dry_run
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"], proc.stdout
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["finished"] and doc["dry_run"] and doc["verdict"] == FAIL
    for name, part in doc["parts"].items():
        assert part["verdict"] in VERDICTS, name
        for check, entry in part["checks"].items():
            assert entry["verdict"] in VERDICTS, (name, check)
            assert entry["verdict"] == PASS or entry["why"], (name, check, entry)
    assert doc["parts"]["env"]["verdict"] == PASS
    assert all(doc["parts"][p.name]["verdict"] == NOT_RUN for p in PARTS if p.name != "env")


def test_missing_cuda_fails_a_run_that_expects_a_gpu(dry_run: Any) -> None:
    proc, out = dry_run
    assert proc.returncode == 1, proc.stderr[-2000:]
    first = (out / "gpu_check.log").read_text().splitlines()[0]
    assert "expecting a GPU: yes (--expect-gpu)" in first
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["parts"]["runner"]["checks"]["cuda_visible"]["verdict"] == FAIL
    assert "runner:cuda_visible" in doc["failed"]


def test_a_part_killed_at_its_limit_keeps_its_record_and_stack_and_leaves_no_process(dry_run: Any) -> None:
    _, out = dry_run
    part = json.loads((out / "gpu_check.json").read_text())["parts"]["selftest_hang"]
    assert part["verdict"] == FAIL and part["timed_out"] and part["secs"] < 30
    assert "killed at its time limit of 8 s" in part["why"]
    assert part["checks"]["before_the_hang"]["verdict"] == PASS
    assert "_hang_until_killed" in part["stack_dump"]  # the watchdog fired inside the limit
    pids = part["checks"]["before_the_hang"]["value"]
    assert not _alive(pids["pid"]) and not _alive(pids["child_pid"])


def test_verdicts_and_exit_status(tmp_path: Path) -> None:
    summary = Summary(tmp_path / "s.json", {})
    part = Part("a", 10, "")
    ok = {"checks": {"x": {"verdict": PASS}, "y": {"verdict": NOT_RUN, "why": "one GPU"}}}
    summary.part_done(part, PartRun("a", 10, 0, 1.0, False, ok, ""))
    summary.finished = True
    assert summary.verdict() == PASS and summary.exit_code() == 0
    summary.not_run(Part("b", 10, ""), "not run: 3 s left", incomplete=True)
    assert summary.verdict() == "incomplete" and summary.exit_code() == 1
    summary.part_done(Part("c", 10, ""), PartRun("c", 10, 3, 1.0, False, ok, ""))
    assert summary.lists()["failed"] == ["c: its process exited with status 3"] and summary.exit_code() == 1
    assert json.loads((tmp_path / "s.json").read_text())["verdict"] == FAIL


def test_expecting_a_gpu_and_the_inner_timeouts() -> None:
    assert expect_gpu(None, small=False, dry_run=False)[0] is True
    assert expect_gpu(False, small=False, dry_run=False)[0] is False
    assert all(inner_timeout_s(p.limit_s) < p.limit_s for p in PARTS)


def test_rank_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAKE_GPUS_ENV, raising=False)
    assert rank_form(True, 2).backend == "nccl" and rank_form(True, 2).multi_gpu
    assert rank_form(True, 1).backend == "gloo" and not rank_form(True, 1).multi_gpu
    monkeypatch.setenv(FAKE_GPUS_ENV, "2")
    faked = rank_form(False, 0)
    assert faked.multi_gpu and faked.backend == "gloo"


def _fake_worker(rank: int, world_size: int, record: str) -> None:
    from shardkit.bench.gpu_check.common import device
    from shardkit.bench.gpu_check.parts_ranks import agreed_check
    from shardkit.bench.gpu_check.results import Outcome

    res = Results("fake", Path(record), resume=True) if rank == 0 else None
    agreed_check(res, "fake:device", lambda: str(device()), lambda got: Outcome(got == ["cpu", "cpu"], got, "cpu"))
    agreed_check(res, "fake:rank1_fails", lambda: 1 / (1 - rank), lambda got: Outcome(True, got, "never reached"))


@pytest.mark.multi
def test_two_faked_gpus_run_the_multi_gpu_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.bench.gpu_check.common import PartContext
    from shardkit.bench.gpu_check.parts_ranks import run_ranks

    monkeypatch.setenv(FAKE_GPUS_ENV, "2")
    res = Results("fake", tmp_path / "fake.json")
    ctx = PartContext(small=True, deadline=time.monotonic() + 60)
    run_ranks(res, ctx, _fake_worker, (str(res.path),), ["fake:device", "fake:rank1_fails", "fake:never"])
    checks = json.loads(res.path.read_text())["checks"]
    assert "multi-GPU form faked" in checks["fake:form"]["value"]["label"]
    assert checks["fake:device"]["verdict"] == PASS and checks["fake:ranks_finished"]["verdict"] == PASS
    failed = checks["fake:rank1_fails"]
    assert failed["verdict"] == FAIL and "rank 1: ZeroDivisionError" in failed["why"]
    assert checks["fake:never"]["verdict"] == FAIL and "not reached" in checks["fake:never"]["why"]
