"""Run one part in a child process of its own process group, under its time limit, and leave nothing behind.

The child writes its records to a private temporary file after every check; the runner polls that file and hands
every change to a callback (which rewrites the one summary JSON), so a part killed at its limit keeps what it
finished. At the limit the whole process group is killed (the part and any ranks it forked). The child also dies
with the runner (``PR_SET_PDEATHSIG``; the part then kills its own group), so a runner killed by the device tool
leaves no part running either.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Optional

from shardkit.bench.gpu_check.results import read_json

POLL_S = 0.5


@dataclass
class PartRun:
    """How one part's process ended, with its last records and any stack dump its watchdog wrote."""

    name: str
    limit_s: float
    rc: Optional[int]
    secs: float
    timed_out: bool
    record: dict[str, Any]
    stack_dump: str


def _child_setup() -> None:
    """In the child before exec: lead a new process group, and get SIGTERM when the runner dies (Linux)."""
    os.setpgid(0, 0)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class PartProcess:
    """The part now running, so a signal to the runner can kill its group too."""

    current: Optional[subprocess.Popen[bytes]] = None

    @classmethod
    def kill(cls) -> None:
        """Kill the running part's whole process group (its ranks too, even once the part itself has exited)."""
        proc = cls.current
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def part_command(name: str, record: Path, stack: Path, limit_s: float, small: bool) -> list[str]:
    """The child's command line."""
    cmd = [sys.executable, "-m", "shardkit.bench.gpu_check.part", name, "--record", str(record)]
    cmd += ["--stack", str(stack), "--limit", f"{limit_s:.1f}"]
    return cmd + (["--small"] if small else [])


def run_part(
    name: str,
    limit_s: float,
    command: list[str],
    record_path: Path,
    stack_path: Path,
    log: IO[str],
    on_progress: Callable[[dict[str, Any]], None] = lambda record: None,
) -> PartRun:
    """Run ``command`` (one part) with its output appended to ``log``; killed with its group at ``limit_s``."""
    log.write(f"=== {name} (limit {limit_s:.0f}s) {time.strftime('%H:%M:%S')}\n")
    log.flush()
    start = time.perf_counter()
    # The part imports this very shardkit, wherever the runner was started from (``cd src``, or PYTHONPATH).
    package_root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_child_setup, env=env)
    PartProcess.current = proc
    seen: Optional[dict[str, Any]] = None
    timed_out = False
    try:
        while proc.poll() is None:
            if time.perf_counter() - start > limit_s:
                timed_out = True
                break
            time.sleep(POLL_S)
            record = read_json(record_path)
            if record is not None and record != seen:
                seen = record
                on_progress(record)
    finally:
        PartProcess.kill()  # at the limit, and always: ranks a finished part left behind go too
        rc = proc.wait()
        PartProcess.current = None
    secs = round(time.perf_counter() - start, 1)
    log.write(f"=== {name} rc={rc} {secs}s{' (killed at its time limit)' if timed_out else ''}\n")
    log.flush()
    stack = stack_path.read_text(errors="replace").strip() if stack_path.exists() else ""
    return PartRun(name, limit_s, rc, secs, timed_out, read_json(record_path) or {}, stack)
