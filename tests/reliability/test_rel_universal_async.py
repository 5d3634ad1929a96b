"""Asynchronous saves: return once staged, publish atomically in the background, surface errors on the next call.

The background write is slowed (one second before the DCP store is written) so the tests can see the state between
the return and the publish: no checkpoint directory yet, training changing the parameters meanwhile, and the final
files holding the state at the time of the call.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from universal_lib import build, optimizer_state, state, train

from shardkit.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    wait_for_checkpoint,
)
from shardkit.checkpoint.universal import save as universal_save
from shardkit.testing import DistributedTestError, run_distributed

#: Set by the saving thread once ``save_checkpoint`` has returned; the background write waits for it, so a save
#: that wrote before returning (not asynchronous) is seen as such by a flag, not by a clock.
_RETURNED = threading.Event()
#: For each background write, whether it found the save already returned (False: it gave up waiting).
_WRITES_AFTER_RETURN: list[bool] = []


def _gate_writes(wait_s: float = 60.0) -> None:
    """Make this process's background writes wait until the caller has returned from ``save_checkpoint``."""
    original = universal_save.write_staged

    def gated(*args: Any, **kwargs: Any) -> None:
        _WRITES_AFTER_RETURN.append(_RETURNED.wait(wait_s))
        original(*args, **kwargs)

    universal_save.write_staged = gated  # type: ignore[assignment]  # this process only


def _async_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    base = Path(root)
    family = build("oss_sdp", seed=0)
    train(family, range(2))
    save_checkpoint(base / "step_2", step=2, model=family.model, optimizer=family.optimizer)
    _gate_writes()
    expected, expected_optim = state(family), optimizer_state(family)
    save_checkpoint(base / "step_3", step=3, model=family.model, optimizer=family.optimizer, async_save=True)
    visible_at_return = (base / "step_3").exists()
    _RETURNED.set()
    train(family, range(2, 3))  # the live state moves on while the background writes the staged copy
    wait_for_checkpoint()
    fresh = build("oss_sdp", seed=9)
    load_checkpoint(base / "step_3", model=fresh.model, optimizer=fresh.optimizer)
    got, got_optim = state(fresh), optimizer_state(fresh)
    same = all(torch.equal(expected[k], got[k]) for k in expected)
    same_optim = expected_optim.keys() == got_optim.keys() and all(
        torch.equal(expected_optim[n][k], got_optim[n][k]) for n in expected_optim for k in expected_optim[n]
    )

    # A failure in the background (rank 1 cannot write its files) is raised by the next call, on every rank.
    original = universal_save.write_local

    def fail_on_rank_1(directory: Path, staged: Any, rank_: int) -> None:
        if rank_ == 1:
            raise OSError("disk full (injected)")
        original(directory, staged, rank_)

    universal_save.write_local = fail_on_rank_1  # type: ignore[assignment]
    save_checkpoint(base / "step_4", step=4, model=family.model, optimizer=family.optimizer, async_save=True)
    try:
        wait_for_checkpoint()
        failure = ""
    except CheckpointError as err:
        failure = str(err)
    universal_save.write_local = original  # type: ignore[assignment]
    return {
        "writes_after_return": list(_WRITES_AFTER_RETURN),
        "visible_at_return": visible_at_return,
        "same": same,
        "same_optim": same_optim,
        "failure": failure,
    }


def test_async_save_returns_before_publishing_and_saves_the_state_of_the_call(tmp_path: Path) -> None:
    results = run_distributed(_async_job, 2, str(tmp_path), timeout_s=120)
    for rank, out in enumerate(results):
        assert out["writes_after_return"] and all(out["writes_after_return"]), (rank, out)
        assert not out["visible_at_return"], (rank, out)
        assert out["same"] and out["same_optim"], rank
        assert "disk full (injected)" in out["failure"] and "rank(s) 1" in out["failure"], (rank, out["failure"])
    assert verify_checkpoint(tmp_path / "step_3").step == 3
    assert not (tmp_path / "step_4").exists()  # the failed save left nothing behind, hidden or not
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]


def _save_then_exit(rank: int, world_size: int, root: str, how: str) -> None:
    base = Path(root)
    family = build("plain", seed=0)
    train(family, range(2))
    save_checkpoint(base / "step_2", step=2, model=family.model, optimizer=family.optimizer)
    _gate_writes()  # the background cannot write before the gate opens
    train(family, range(2, 3))
    save_checkpoint(base / "step_3", step=3, model=family.model, optimizer=family.optimizer, async_save=True)
    if how == "crash":
        os._exit(3)  # dies with the gate shut: the background never publishes; no atexit
    # Opened only once the process exits (atexit runs the last registered first, so before shardkit's wait): the
    # save is certainly still pending then, and the exit must wait for it.
    atexit.register(_RETURNED.set)


def test_crash_before_publish_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(DistributedTestError, match=r"died|exit"):
        run_distributed(_save_then_exit, 1, str(tmp_path), "crash", timeout_s=60)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
    assert not (tmp_path / "step_3").exists()


def test_normal_exit_waits_for_the_save(tmp_path: Path) -> None:
    """A process that returns right after an asynchronous save still publishes it (the atexit wait)."""
    script = (
        "import sys; sys.path[:0] = sys.argv[2:]; from test_rel_universal_async import _save_then_exit; "
        "_save_then_exit(0, 1, sys.argv[1], 'return')"
    )
    here = Path(__file__).parent  # this folder, and tests/ for testkit
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), str(here), str(here.parent)], capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3"
    assert verify_checkpoint(tmp_path / "step_3").step == 3
