"""Calls every rank of a group must make: refused at once, on every rank, when some ranks do not.

A gathering call made by some ranks only (``state_dict()`` on rank 0, ``smp.allgather`` inside ``if rank == 0``)
leaves those ranks blocked in a collective the others never join; both sides then wait in mismatched collectives
until the process group's timeout (30 minutes by default) with an error that names neither the call nor the rank.
Before such a call issues any collective, :func:`every_rank_calls` has each rank post the call's name in the
process group's store under its call number and wait for every rank's post of the same number. This uses the
store only, so it cannot pair up with a collective another rank is running. A rank the others never join raises
after the timeout, naming the call and the ranks missing, and records its failure, so the other ranks' next
collective errors name it too (at once when the failed rank exits). Ranks that made different calls at the same
point raise on every rank.

The timeout is 90% of the active collective checks' (``SHARDKIT_CHECK_COLLECTIVES=1``, ``check_collectives()``)
when there are some, else of the process group's: the waiting rank then reports before the other ranks'
collectives time out, and their errors name it. Costs a few store round trips per call.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.groups import GroupLike, group_size, is_dummy, torch_group
from shardkit.distributed.health import active_check_timeout_s, default_store, report_failure

_PREFIX = "shardkit/calls"


def group_timeout(group: Optional[GroupLike] = None) -> timedelta:
    """How long a collective of ``group`` (default: the world) waits before it fails: the timeout the group was
    created with (torch's default when it cannot be read)."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):  # a group may run on either, or both
        with contextlib.suppress(Exception):
            timeout = pg._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
            if isinstance(timeout, timedelta):
                return timeout
    return dist.default_pg_timeout


def check_timeout(group: GroupLike) -> timedelta:
    """How long :func:`every_rank_calls` waits for the other ranks of ``group`` (see the module docstring)."""
    check = active_check_timeout_s()
    return (timedelta(seconds=check) if check is not None else group_timeout(group)) * 0.9


def _wait_for(store: Any, keys: list[str], timeout: timedelta) -> bool:
    """Poll until every key exists; False after ``timeout`` (``store.wait`` overshoots short timeouts by
    seconds on a file store)."""
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.001
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return True


def every_rank_calls(group: GroupLike, what: str, hint: str, family: str) -> None:
    """Return once every rank of ``group`` has called ``what`` (e.g. ``"state_dict()"``) as its next such call.

    ``hint`` says how to call it right (it ends the timeout error); ``family`` names the API whose calls are
    counted together (``"FullyShardedDataParallel"``, ``"smp"``): calls of one family share one sequence per
    group. Raises ``RuntimeError`` on a rank the others do not join within :func:`check_timeout`, and on every
    rank when ranks made different calls. A dummy or single-rank group, or no ``torch.distributed``, returns at
    once.

    Example::

        every_rank_calls(group, "smp.allgather(obj, DP_GROUP)", "call it on every rank of the group", "smp")
    """
    if is_dummy(group) or group_size(group) == 1 or not dist.is_initialized():
        return
    store = default_store()
    if store is None:
        return
    ranks = dist.get_process_group_ranks(torch_group(group, what))
    me = dist.get_rank()
    base = f"{_PREFIX}/{family}/{'-'.join(map(str, ranks))}"
    number = store.add(f"{base}/count/{me}", 1)
    keys = {rank: f"{base}/{number}/{rank}" for rank in ranks}
    store.set(keys[me], what)
    timeout = check_timeout(group)
    if not _wait_for(store, list(keys.values()), timeout):
        missing = [rank for rank, key in keys.items() if not store.check([key])]
        error = RuntimeError(
            f"{what} was called on rank {me}, but rank(s) {missing} of its group {ranks} did not call it within "
            f"{timeout.total_seconds():.0f} s. {hint}; a call made by some ranks only leaves the others waiting in "
            "mismatched collectives."
        )
        report_failure(error)
        raise error from None
    calls = {rank: store.get(key).decode() for rank, key in keys.items()}
    if len(set(calls.values())) > 1:
        listing = ", ".join(f"rank {rank}: {call}" for rank, call in calls.items())
        raise RuntimeError(
            f"ranks of group {ranks} made different {family} calls at the same point ({listing}); every rank must "
            "make the same calls in the same order."
        )


__all__ = ["check_timeout", "every_rank_calls", "group_timeout"]
