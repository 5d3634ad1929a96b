"""Methods every rank must call (they gather from every rank): refused at once when some ranks do not.

``state_dict()`` on rank 0 only is the classic mistake: rank 0 blocks in its first all-gather while the other
ranks go on, and both sides wait in mismatched collectives until the process group's timeout (30 minutes by
default) with an error that names neither the call nor the rank. Before such a method issues any collective,
:func:`every_rank_calls` has each rank post the method's name in the process group's store under its call
number and wait for every rank's post of the same number. This uses the store only, so it cannot pair up with
a collective another rank is running. A rank the others never join raises after the timeout, naming the
method and the ranks missing, and records its failure, so the other ranks' next collective errors name it too
(at once when the failed rank exits). Ranks that called different methods raise on every rank.

The timeout is 90% of the active collective checks' (``SHARDKIT_CHECK_COLLECTIVES=1``,
``check_collectives()``) when there are some, else of the process group's: the waiting rank then reports
before the other ranks' collectives time out, and their errors name it. Costs a few store round trips per
call, on calls that already move the whole model; never on the training step.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardkit.distributed.groups import GroupLike, group_size, is_dummy, torch_group
from shardkit.distributed.health import active_check_timeout_s, default_store, report_failure
from shardkit.nn.fsdp._collectives import group_timeout

_PREFIX = "shardkit/fsdp/calls"


def _wait_timeout(group: GroupLike) -> timedelta:
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


def every_rank_calls(group: GroupLike, what: str) -> None:
    """Return once every rank of ``group`` has called ``what`` (e.g. ``"state_dict()"``) as its next such call.

    Raises ``RuntimeError`` on a rank the others do not join within the timeout, and on every rank when ranks
    called different methods. A dummy or single-rank group, or no ``torch.distributed``, returns at once.
    """
    if is_dummy(group) or group_size(group) == 1 or not dist.is_initialized():
        return
    store = default_store()
    if store is None:
        return
    ranks = dist.get_process_group_ranks(torch_group(group, what))
    me = dist.get_rank()
    base = f"{_PREFIX}/{'-'.join(map(str, ranks))}"
    number = store.add(f"{base}/count/{me}", 1)
    keys = {rank: f"{base}/{number}/{rank}" for rank in ranks}
    store.set(keys[me], what)
    timeout = _wait_timeout(group)
    if not _wait_for(store, list(keys.values()), timeout):
        missing = [rank for rank, key in keys.items() if not store.check([key])]
        error = RuntimeError(
            f"{what} was called on rank {me}, but rank(s) {missing} of its group {ranks} did not call it within "
            f"{timeout.total_seconds():.0f} s. {what} gathers from every rank, so every rank must call it (for "
            "example call model.state_dict() on every rank and save the result on rank 0 only); a call made by "
            "some ranks only leaves the others waiting in mismatched collectives."
        )
        report_failure(error)
        raise error from None
    calls = {rank: store.get(key).decode() for rank, key in keys.items()}
    if len(set(calls.values())) > 1:
        listing = ", ".join(f"rank {rank}: {call}" for rank, call in calls.items())
        raise RuntimeError(
            f"ranks of group {ranks} called different FullyShardedDataParallel methods at the same point ({listing}); "
            "every rank must make the same calls in the same order."
        )
