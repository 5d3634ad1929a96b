"""every_rank_calls: a call made by some ranks only is reported (a warning naming the call and the missing ranks,
then an error on every rank that made it, and at once on a rank that makes it late), never a silent hang."""

from __future__ import annotations

import time
from typing import Optional

import pytest
import torch.distributed as dist

from shardkit.distributed.arrival import ENV_TIMEOUT, ENV_WARN_AFTER, MissedCallError, arrival_policy, every_rank_calls
from shardkit.distributed.health import failed_ranks
from shardkit.testing import run_distributed
from testkit.logs import WarningRecorder

#: A short deadline and an early warning, so each test takes seconds; the group's own timeout is much longer.
FAST = {ENV_TIMEOUT: "2", ENV_WARN_AFTER: "0.3"}
GROUP_TIMEOUT_S = 60.0


def _capture() -> WarningRecorder:
    return WarningRecorder().attach()


def _wait_for_failure_of(rank: int) -> None:
    """Block until ``rank`` has reported its failure (the harness records it), however slow the machine is."""
    while rank not in failed_ranks():
        time.sleep(0.05)


def _attempt(what: str) -> Optional[str]:
    try:
        every_rank_calls(what, None, "Do it right.")
    except MissedCallError as err:
        return str(err)
    return None


def _some_ranks_call(rank: int, world_size: int, callers: list[int]) -> tuple[Optional[str], list[str]]:
    records = _capture()
    if rank in callers:
        return _attempt("Thing.gather()"), records.messages
    _wait_for_failure_of(callers[0])
    return _attempt("Thing.gather()"), records.messages  # late: the others gave up


def test_a_call_on_one_rank_warns_then_fails_on_every_rank() -> None:
    (error0, warnings0), (error1, warnings1) = run_distributed(
        _some_ranks_call, 2, [0], timeout_s=GROUP_TIMEOUT_S, rank_env=[FAST, FAST]
    )
    assert error0 is not None and error1 is not None
    assert "Thing.gather() was called on rank(s) [0], but rank(s) [1] of group [0, 1] did not call it" in error0
    assert "Do it right." in error0 and ENV_TIMEOUT in error0
    assert error1.startswith("rank 1 reached Thing.gather() after the other ranks gave up on it: ")
    assert error0 in error1
    assert any("Thing.gather()" in w and "for rank(s) [1]" in w for w in warnings0)
    assert warnings1 == []


def test_two_of_three_ranks_both_fail_naming_the_third() -> None:
    results = run_distributed(_some_ranks_call, 3, [0, 1], timeout_s=GROUP_TIMEOUT_S, rank_env=[FAST] * 3)
    for error, warnings in results[:2]:
        assert error is not None and "but rank(s) [2] of group [0, 1, 2] did not call it" in error
        assert any("for rank(s) [2]" in w for w in warnings)
    assert results[2][0] is not None and "after the other ranks gave up" in results[2][0]


def _different_calls(rank: int, world_size: int) -> Optional[str]:
    return _attempt("First.call()" if rank == 0 else "Second.call()")


def test_different_calls_fail_at_once_on_every_rank() -> None:
    errors = run_distributed(_different_calls, 2, timeout_s=GROUP_TIMEOUT_S, rank_env=[{ENV_TIMEOUT: "50"}] * 2)
    for error in errors:
        assert error is not None and "made different calls" in error
        assert "First.call()" in error and "Second.call()" in error


def _every_rank_calls_repeatedly(rank: int, world_size: int) -> list[Optional[str]]:
    outcomes = [_attempt("A.call()") for _ in range(20)]
    if rank == 1:
        time.sleep(0.5)  # rank 0 waits a moment: a late rank within the deadline is fine
    outcomes.append(_attempt("B.call()"))
    dist.barrier()
    return outcomes


def test_calls_every_rank_makes_pass() -> None:
    for outcomes in run_distributed(_every_rank_calls_repeatedly, 2, timeout_s=GROUP_TIMEOUT_S):
        assert outcomes == [None] * 21


def _policy(rank: int, world_size: int) -> tuple[float, float]:
    policy = arrival_policy()
    return policy.timeout_s, policy.warn_after_s


def test_the_deadline_defaults_to_three_minutes_and_stays_below_the_group_timeout() -> None:
    assert run_distributed(_policy, 2, timeout_s=600)[0] == (180.0, 20.0)
    # 0: as long as the group's timeout allows; a setting above it is capped below it.
    assert run_distributed(_policy, 2, timeout_s=100, rank_env=[{ENV_TIMEOUT: "0"}] * 2)[0] == (90.0, 20.0)
    assert run_distributed(_policy, 2, timeout_s=100, rank_env=[{ENV_TIMEOUT: "500"}] * 2)[0] == (90.0, 20.0)


def test_a_bad_setting_says_what_it_expects(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.distributed.arrival import _env_seconds

    monkeypatch.setenv(ENV_TIMEOUT, "3min")
    with pytest.raises(ValueError, match="SHARDKIT_CALL_TIMEOUT='3min' is not a number of seconds"):
        _env_seconds(ENV_TIMEOUT, 180.0)
