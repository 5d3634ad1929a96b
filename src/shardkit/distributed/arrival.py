"""Calls every rank must make, checked before their first collective: a warning, then an error, never a hang.

``model.state_dict()`` on rank 0 only is the classic mistake: rank 0 blocks in its first all-gather while the other
ranks go on, and both sides wait in mismatched collectives until the process group's timeout (30 minutes by
default) with an error that names neither the call nor the rank. Every call that gathers from every rank (FSDP's
state-dict, summon and optimizer-state calls, OSS's ``consolidate_state_dict``, ``save_checkpoint`` and
``load_checkpoint``, smp's gathers) first enters :func:`every_rank_calls`, which meets the other ranks through the
process group's key-value store, never through a collective, so it cannot pair up with a collective another rank
is running and behaves the same on gloo and NCCL.

A rank that waits logs a warning after :data:`ENV_WARN_AFTER` seconds (20 by default) naming the call and the
ranks that have not made it, and again every minute; after :data:`ENV_TIMEOUT` seconds (180 by default, ``0`` to
wait as long as the process group's timeout allows) every rank that made the call raises
:class:`MissedCallError`, and a rank that makes it later raises the same error at once. The deadline never exceeds
90% of the group's own timeout (or of the active collective checks'), so this error always comes first.
Ranks that made different such calls at the same point raise at once, on every rank.

Cost: four store round trips on the rank that arrives last, a few more polls on the others (well under a
millisecond on one node); only these calls pay it, never the training step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from shardkit.distributed.groups import GroupLike, group_size, group_timeout, is_dummy, torch_group
from shardkit.distributed.health import active_check_timeout_s, default_store, report_failure

#: Seconds a rank waits for the others at a call every rank must make before it raises (default 180; ``0``: up
#: to 90% of the process group's timeout).
ENV_TIMEOUT = "SHARDKIT_CALL_TIMEOUT"
#: Seconds before the first warning (default 20); the warning then repeats every minute.
ENV_WARN_AFTER = "SHARDKIT_CALL_WARN_AFTER"
DEFAULT_TIMEOUT_S = 180.0
DEFAULT_WARN_AFTER_S = 20.0
WARN_EVERY_S = 60.0

_PREFIX = "shardkit/calls"
#: Added to a call's arrival counter to close it: a negative count means the call was given up.
_CLOSED = -(1 << 40)
_LOG = logging.getLogger("shardkit.distributed")


class MissedCallError(RuntimeError):
    """Some ranks made a call every rank must make, and the others did not (or made another such call)."""


@dataclass(frozen=True)
class ArrivalPolicy:
    """How long a rank waits for the others at a call every rank must make."""

    #: Seconds until the call fails on every rank that made it.
    timeout_s: float
    #: Seconds until the first warning.
    warn_after_s: float
    #: Seconds between later warnings.
    warn_every_s: float = WARN_EVERY_S


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds (e.g. {name}=300)") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be >= 0 seconds")
    return value


def arrival_policy(group: Optional[GroupLike] = None) -> ArrivalPolicy:
    """The waiting policy from the environment, capped below the timeouts of ``group`` and of active checks."""
    ceiling = group_timeout(group).total_seconds()
    check = active_check_timeout_s()
    if check is not None:
        ceiling = min(ceiling, check)
    configured = _env_seconds(ENV_TIMEOUT, DEFAULT_TIMEOUT_S)
    timeout = 0.9 * ceiling if configured == 0 else min(configured, 0.9 * ceiling)
    return ArrivalPolicy(timeout_s=timeout, warn_after_s=_env_seconds(ENV_WARN_AFTER, DEFAULT_WARN_AFTER_S))


@dataclass(frozen=True)
class _Call:
    """The store keys of one call (the ``number``-th such call of this rank in this group)."""

    store: Any
    what: str
    ranks: list[int]
    me: int
    base: str
    number: int

    def key(self, name: str) -> str:
        return f"{self.base}/{self.number}/{name}"

    def calls_made(self, rank: int) -> int:
        return int(self.store.add(f"{self.base}/count/{rank}", 0))

    def missing(self) -> list[int]:
        return [rank for rank in self.ranks if self.calls_made(rank) < self.number]

    def closed_message(self) -> Optional[str]:
        if not self.store.check([self.key("closed")]):
            return None
        return self.store.get(self.key("closed")).decode(errors="replace")

    def close(self, message: str) -> str:
        """Give the call up with ``message`` (the first closer's message wins); returns the message that won."""
        won = self.store.compare_set(self.key("closed"), "", message).decode(errors="replace")
        self.store.add(self.key("arrived"), _CLOSED)
        return won


def _group_ranks(group: Optional[GroupLike], what: str) -> list[int]:
    pg = torch_group(group, what) if group is not None else dist.group.WORLD
    return list(dist.get_process_group_ranks(pg))


def every_rank_calls(what: str, group: Optional[GroupLike] = None, advice: str = "") -> None:
    """Return once every rank of ``group`` (default: the world) has made ``what`` as its next such call.

    ``what`` names the call as the user wrote it (``"FullyShardedDataParallel.state_dict()"``); ``advice`` says
    how to call it right, and ends every message. Raises :class:`MissedCallError` on every rank that made the
    call when some ranks do not make it within the policy's timeout (:func:`arrival_policy`), or at once when
    ranks made different such calls. A dummy or single-rank group, or no process group, returns at once.

    Example::

        def consolidate(self):
            every_rank_calls("OSS.consolidate_state_dict()", self.group, "call it on every rank")
            ...  # the collectives
    """
    if (group is not None and is_dummy(group)) or not dist.is_available() or not dist.is_initialized():
        return
    if group_size(group) == 1:
        return
    store = default_store()
    if store is None:
        return
    ranks = _group_ranks(group, what)
    tag = f"{len(ranks)}-{zlib.crc32(','.join(map(str, ranks)).encode()):08x}"
    me = dist.get_rank()
    base = f"{_PREFIX}/{tag}"
    call = _Call(store, what, ranks, me, base, int(store.add(f"{base}/count/{me}", 1)))
    first = store.compare_set(call.key("name"), "", f"{me}\n{what}").decode(errors="replace")
    first_rank, _, first_what = first.partition("\n")
    if first_what != what:
        message = (
            f"ranks of group {ranks} made different calls that every rank must make, at the same point: rank "
            f"{first_rank} called {first_what} while rank {me} called {what}. Every rank must make the same such "
            "calls in the same order."
        )
        _fail(call, message)
    arrived = int(store.add(call.key("arrived"), 1))
    if arrived == len(ranks):
        return
    if arrived < 0:
        _fail(call, _await_closed(call), late=True)
    _wait(call, arrival_policy(group), advice)


def _await_closed(call: _Call) -> str:
    """The message of a call another rank is closing (it writes the message just before closing the count)."""
    for _ in range(200):
        message = call.closed_message()
        if message is not None:
            return message
        time.sleep(0.01)
    return f"{call.what} was given up by another rank of group {call.ranks}"


def _wait(call: _Call, policy: ArrivalPolicy, advice: str) -> None:
    start = time.monotonic()
    next_warning = start + policy.warn_after_s
    pause = 0.0005
    while True:
        count = int(call.store.add(call.key("arrived"), 0))
        if count == len(call.ranks):
            return
        if count < 0:
            message = call.closed_message()
            if message is not None:
                _fail(call, message)
        now = time.monotonic()
        if now >= start + policy.timeout_s:
            _give_up(call, policy, advice)
            return
        if now >= next_warning:
            _warn(call, now - start, policy, advice)
            next_warning = now + policy.warn_every_s
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _warn(call: _Call, waited_s: float, policy: ArrivalPolicy, advice: str) -> None:
    _LOG.warning(
        "rank %d has waited %.0f s in %s for rank(s) %s of group %s, which have not called it. Every rank must "
        "call it; a call made by some ranks only would hang. Failing in %.0f s (%s). %s",
        call.me,
        waited_s,
        call.what,
        call.missing(),
        call.ranks,
        max(0.0, policy.timeout_s - waited_s),
        ENV_TIMEOUT,
        advice,
    )


def _give_up(call: _Call, policy: ArrivalPolicy, advice: str) -> None:
    """Close the call and raise, unless the last rank arrived in the very moment of the decision."""
    count = int(call.store.add(call.key("arrived"), _CLOSED))
    if count == len(call.ranks) + _CLOSED:  # everyone is here after all: reopen and go on
        call.store.add(call.key("arrived"), -_CLOSED)
        return
    missing = call.missing()
    present = [rank for rank in call.ranks if rank not in missing]
    message = (
        f"{call.what} was called on rank(s) {present}, but rank(s) {missing} of group {call.ranks} did not call it "
        f"within {policy.timeout_s:.0f} s. It gathers from every rank, so every rank must call it; a call made by "
        f"some ranks only leaves the others waiting forever. {advice} If a rank is legitimately that much later, "
        f"raise the limit with {ENV_TIMEOUT}=<seconds> ({ENV_TIMEOUT}=0 waits as long as the process group's "
        "timeout allows)."
    ).replace("  ", " ")
    _fail(call, call.close(message))


def _fail(call: _Call, message: str, late: bool = False) -> None:
    if late:
        message = f"rank {call.me} reached {call.what} after the other ranks gave up on it: {message}"
    with contextlib.suppress(Exception):
        call.close(message)
    error = MissedCallError(message)
    report_failure(error)
    raise error


def call_deadline(group: Optional[GroupLike] = None) -> timedelta:
    """How long :func:`every_rank_calls` waits for the other ranks of ``group`` under the current settings."""
    return timedelta(seconds=arrival_policy(group).timeout_s)
