"""Run a script under the real ``torchrun`` (``python -m torch.distributed.run``), as a user would.

For what only a script shows: an uncaught exception reaching ``sys.excepthook``, a clean interpreter exit, a
restarted worker's environment. ``launch_local`` runs functions, which torch's worker wrapper calls inside its own
``try``; use it everywhere else (it is faster).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

from shardkit.launch import free_port

SRC = Path(__file__).resolve().parents[2] / "src"


def run_torchrun(
    script: Path,
    *args: str,
    nproc: int = 2,
    torchrun_args: tuple[str, ...] = (),
    env: Optional[dict[str, str]] = None,
    timeout_s: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node nproc [torchrun_args] script args`` on one node with shardkit's sources on the
    path; returns the finished process (stdout and stderr together in ``stdout``). After ``timeout_s`` the agent and
    its workers are killed and the test fails."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--monitor-interval=0.1",
        *torchrun_args,
        str(script),
        *args,
    ]
    environment = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    environment.update(env or {})
    # A session of its own: a hung run's workers (the agent's children) are killed with it, not left behind.
    agent = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = agent.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        output, _ = agent.communicate()
        raise AssertionError(
            f"torchrun {script.name} {' '.join(args)} ran past {timeout_s} s:\n{output[-4000:]}"
        ) from None
    return subprocess.CompletedProcess(command, agent.returncode, output)
