"""Run the gpu-check parts, each in its own process under its own time limit, and write one JSON and one log.

    python -m shardkit.bench.gpu_check [--out DIR] [--small] [--parts env,fsdp]

``DIR`` defaults to ``$OUT`` (the device tool's folder), else ``./gpu_check_out``. It receives ``gpu_check.log``
(every part's output), ``gpu_check.json`` (every check of every part, plus each part's exit code, time and
whether it hit its limit) and one ``part_<name>.json`` per part. Exit status 0 unless the plumbing itself broke:
failed checks are findings, recorded in the JSON. Without CUDA, and without ``--small``, only the plumbing runs
(the ``env`` part at toy size) and the JSON says ``"dry_run": true``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

#: Name, time limit (seconds) and what it shows; run in this order, most valuable first. The limits add up to
#: 490 s, more than :data:`BUDGET_S` (8 minutes, as asked): a part gets what is left, so a slow run squeezes the
#: least valuable parts at the end, never the first ones.
PARTS: tuple[tuple[str, int, str], ...] = (
    ("env", 30, "versions, every module imported, private torch APIs"),
    ("strategies", 70, "every strategy at world size 1 on NCCL against the unwrapped model"),
    ("fsdp", 50, "FSDP on real streams (prefetch, lagging side streams), pinned offload, bf16"),
    ("compile", 75, "torch.compile (inductor) of shardkit FSDP against eager"),
    ("checkpoint", 30, "universal checkpoint from GPU memory, sync and async, host peak"),
    ("gloo_ranks", 45, "two ranks on one GPU over gloo with CUDA tensors"),
    ("pipeline", 45, "every smp schedule (split backward on CUDA's autograd threads) over two ranks on one GPU"),
    ("cuda_tests", 40, "the CUDA-only tests under pytest"),
    ("plan", 55, "plan's accelerator estimate against max_memory_allocated, ~1B model, DDP and FSDP"),
    ("throughput", 50, "plain vs shardkit FSDP vs torch FSDP2 on the ~1B model: tokens/s, peak memory"),
)
#: Wall seconds for all parts together (process starts included): a part gets what is left if that is less
#: than its own limit, and is skipped with under 10 s left.
BUDGET_S = 480


@dataclass
class PartRun:
    """How one part's process ended."""

    name: str
    rc: Optional[int]
    secs: float
    timed_out: bool


def run_part(
    name: str, limit_s: float, out: Path, small: bool, log: Any, command: Optional[list[str]] = None
) -> PartRun:
    """Run one part in a child process, its output appended to ``log``; killed at ``limit_s`` (never raises)."""
    cmd = command or [sys.executable, "-m", "shardkit.bench.gpu_check.part", name, "--out", str(out)]
    if small and command is None:
        cmd.append("--small")
    log.write(f"=== {name} (limit {limit_s:.0f}s) {time.strftime('%H:%M:%S')}\n")
    log.flush()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        rc: Optional[int] = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, 9)  # the part and any ranks it spawned
        rc = proc.wait()
    secs = round(time.perf_counter() - start, 1)
    log.write(f"=== {name} rc={rc} {secs}s{' (time limit)' if timed_out else ''}\n")
    log.flush()
    return PartRun(name, rc, secs, timed_out)


def merge(out: Path, runs: list[PartRun], skipped: dict[str, str], info: dict[str, Any]) -> dict[str, Any]:
    """The one JSON: per part its process outcome and its checks; the failed checks listed on top."""
    parts: dict[str, Any] = {}
    failed: list[str] = []
    for run in runs:
        path = out / f"part_{run.name}.json"
        checks = json.loads(path.read_text()).get("checks", {}) if path.exists() else {}
        ok = run.rc == 0 and not run.timed_out and all(c.get("ok") for c in checks.values())
        parts[run.name] = {"rc": run.rc, "secs": run.secs, "timed_out": run.timed_out, "ok": ok, "checks": checks}
        failed += [f"{run.name}:{k}" for k, c in checks.items() if not c.get("ok")]
        if run.rc != 0 or run.timed_out:
            failed.append(f"{run.name}:<process rc={run.rc}{' timed out' if run.timed_out else ''}>")
    for name, reason in skipped.items():
        parts[name] = {"skipped": reason}
    return {**info, "parts": parts, "failed": failed}


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m shardkit.bench.gpu_check", description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    parser.add_argument("--small", action="store_true", help="toy sizes on any device (checks the script)")
    parser.add_argument("--parts", default="", help="comma-separated subset of: " + ", ".join(p[0] for p in PARTS))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    cuda = torch.cuda.is_available()
    wanted = [p for p in PARTS if not args.parts or p[0] in args.parts.split(",")]
    dry_run = not cuda and not args.small
    skipped: dict[str, str] = {}
    if dry_run:
        print("gpu-check: no CUDA device here; dry run of the plumbing only (the env part at toy size)", flush=True)
        skipped = {name: "no CUDA (dry run)" for name, _, _ in wanted if name != "env"}
        wanted = [p for p in wanted if p[0] == "env"]
    info = {"cuda": cuda, "dry_run": dry_run, "small": args.small or dry_run, "torch": torch.__version__,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}  # fmt: skip
    runs = []
    start = time.perf_counter()
    with (out / "gpu_check.log").open("a") as log:
        for name, limit, _ in wanted:
            left = BUDGET_S - (time.perf_counter() - start)
            if left < 10:
                skipped[name] = f"no time left in the {BUDGET_S} s budget"
                continue
            runs.append(run_part(name, min(limit, left), out, args.small or dry_run, log))
            print(f"gpu-check: {name}: rc={runs[-1].rc} {runs[-1].secs}s", flush=True)
    summary = merge(out, runs, skipped, info)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({"failed": summary["failed"], "json": str(out / "gpu_check.json")}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
