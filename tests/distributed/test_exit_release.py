"""Process groups that shardkit holds process-wide are destroyed before the interpreter finalises.

A gloo group alive into finalisation can abort the exit after all of a script's work ("terminate called without an
active exception": a worker thread dropping a finished collective's tensors asks for the GIL while the interpreter
finalises; :mod:`shardkit.distributed.exit_release`). Before the exit hook, shardkit's Topology cache, the
tensor-parallel state, the checkpoint group and smp's state kept their groups, and the world, alive past
``destroy_process_group()``; these scripts then ended with gloo workers still running (2 to 10 per rank).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shardkit.distributed import exit_release
from testkit.torchrun import run_torchrun

SCRIPT = Path(__file__).with_name("exit_release_script.py")


@pytest.mark.multi
@pytest.mark.parametrize("mode", ["holders", "smp"])
def test_no_gloo_worker_outlives_the_exit_handlers(tmp_path: Path, mode: str) -> None:
    done = run_torchrun(SCRIPT, mode, str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "0", done.stdout[-3000:]


def test_every_release_runs_and_failures_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exit_release, "_RELEASERS", [])
    calls: list[str] = []

    def broken() -> None:
        raise RuntimeError("on purpose")

    exit_release.release_at_exit("first", lambda: calls.append("stale"))
    exit_release.release_at_exit("broken", broken)
    exit_release.release_at_exit("first", lambda: calls.append("first"))  # the same name again: the last one counts
    exit_release.release_at_exit("last", lambda: calls.append("last"))
    assert exit_release.release_now() == ["broken: RuntimeError: on purpose"]
    assert calls == ["first", "last"]


def test_worker_states_are_read_from_proc() -> None:
    import torch.distributed as dist

    from shardkit.launch import free_port

    before = len(exit_release.gloo_worker_states())  # other tests in this process may hold groups
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
    group = dist.ProcessGroupGloo(store, 0, 1)
    try:
        deadline = time.monotonic() + 30
        states = exit_release.gloo_worker_states()
        while len(states) == before and time.monotonic() < deadline:  # a worker names itself once it runs
            time.sleep(0.01)
            states = exit_release.gloo_worker_states()
        assert len(states) > before and all(len(state) == 1 for state in states)
        assert exit_release.settle_gloo_workers(limit_s=5.0)  # idle workers sleep
    finally:
        del group
    assert len(exit_release.gloo_worker_states()) == before  # destroying the group joined its workers


def test_the_exit_goes_on_when_a_release_blocks(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import threading

    monkeypatch.setattr(exit_release, "_RELEASERS", [])
    monkeypatch.setattr(exit_release, "EXIT_RELEASE_S", 0.2)
    gate = threading.Event()
    exit_release.release_at_exit("stuck", gate.wait)  # as a group whose collective a peer never entered
    try:
        exit_release._at_exit()
    finally:
        gate.set()
    assert "process groups were still busy 0.2 s into the exit" in capsys.readouterr().err
