"""Issue 32, item 14: a worker restarted by ``torchrun --max-restarts`` without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.

Where shardkit starts the process group (``shardkit.restarts.init_process_group``: smp's automatic start, the demo)
the restart works; where the script calls torch's ``init_process_group`` itself, which can then fail in gloo's
``connectFullMesh``, every restarted worker's first line says what to set.
"""

from __future__ import annotations

from pathlib import Path

from testkit.torchrun import run_torchrun

SCRIPT = Path(__file__).with_name("restart_script.py")
RESTART = ("--max-restarts=1",)
UNSET = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}


def test_a_restart_through_shardkits_init_works_without_the_variable() -> None:
    done = run_torchrun(SCRIPT, "shardkit", torchrun_args=RESTART, env=UNSET)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "round 1 rank 0: done 4" in done.stdout and "round 1 rank 1: done 4" in done.stdout


def test_a_restarted_worker_says_what_to_set_on_its_first_line() -> None:
    done = run_torchrun(SCRIPT, "report", torchrun_args=RESTART, env=UNSET)
    for rank in (0, 1):
        # this worker's own lines, in its order (the two workers' lines interleave in any order)
        lines = [
            line.removeprefix(f"rank {rank}| ")
            for line in done.stdout.splitlines()
            if line.startswith((f"rank {rank}| ", f"round 0 rank {rank}:", f"round 1 rank {rank}:"))
        ]
        started = lines.index(f"round 1 rank {rank}: started")
        assert lines[started - 1].startswith("shardkit: this worker was restarted by torchrun (restart 1)"), lines
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in done.stdout
