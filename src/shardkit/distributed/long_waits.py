"""A word for every long wait: a rank blocked in one of shardkit's collectives or point-to-point transfers says so.

gloo's and NCCL's ``wait()`` return when the other ranks have made the matching call, or when the process group
times out (30 minutes by default, 10 for NCCL). A rank whose peer is slower (data loading, a first compile), stuck,
or dead therefore sits silent for half an hour. Here every blocking wait registers what it waits for and since
when in a table that one daemon thread per process reads when the next warning is due; a wait older than
:data:`ENV_WARN_AFTER` seconds (45 by default, so the first word comes within a minute; ``0`` turns the watch off)
is logged as a warning on the ``shardkit`` logger at that age, naming the rank, the operation and the rank it waits
for (the peer of a transfer, the other rank of a two-rank group; in a larger group the candidates), and again every
minute while it lasts. The wait itself is not touched (no polling, no timeout of its own), so it costs the waiting
thread a clock read and two dictionary updates; it works the same for waits issued from autograd's device threads
(backward hooks on CUDA). Idle, the thread wakes once per threshold.

What it cannot see: under NCCL, ``wait()`` on a CUDA collective only makes the current stream wait and returns, so
a stuck peer blocks the host later, at the next synchronisation (``loss.item()``, a copy to the CPU), outside any
shardkit call. NCCL's own watchdog reports those at its timeout. The object collectives, the barrier, gloo's
collectives and waits on CPU tensors are all covered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

#: Seconds a wait lasts before its first warning (default 45; ``0`` or less: no warnings).
ENV_WARN_AFTER = "SHARDKIT_WAIT_WARN_AFTER"
DEFAULT_WARN_AFTER_S = 45.0
#: Seconds between the warnings of one wait that goes on.
REPEAT_S = 60.0

logger = logging.getLogger("shardkit")


#: What a wait in a collective usually means, said with its warning.
PEER_HINT = (
    "the other ranks have not made the matching call yet. One may be slower (loading data, compiling), stuck, or "
    "have failed; the process group's timeout ends the wait with an error if nothing arrives."
)
#: What the ranks a collective waits for may be doing, said after naming them.
_LATE = (
    "A late rank may be slower (loading data, compiling), stuck, or have failed; the process group's timeout ends "
    "the wait with an error if nothing arrives."
)
#: A wait whose peers are not known (a hand-built transfer names its peer in ``what``).
UNKNOWN_PEERS = object()


@dataclass
class _Wait:
    what: str
    hint: str
    since: float
    next_warning: float
    #: The process group whose other members it waits for (None: the world), or :data:`UNKNOWN_PEERS`.
    group: Any = UNKNOWN_PEERS


class WaitWatch:
    """The process's open waits and the daemon thread that reports the long ones (started at the first wait)."""

    def __init__(self, warn_after_s: Optional[float] = None) -> None:
        self.warn_after_s = _env_seconds() if warn_after_s is None else warn_after_s
        self._lock = threading.Lock()
        self._waits: dict[int, _Wait] = {}
        self._thread: Optional[threading.Thread] = None
        self._wake = threading.Event()
        # A forked child inherits this object but not the thread, and maybe the lock held by it: start afresh.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._waits = {}
        self._thread = None
        self._wake = threading.Event()

    def set_warn_after(self, seconds: float) -> None:
        """Warn about waits older than ``seconds`` from now on (``0`` or less: no warnings)."""
        self.warn_after_s = seconds
        self._wake.set()  # a watch thread sleeping on the old threshold's interval re-reads it now

    def open_waits(self) -> list[str]:
        """What each wait in progress in this process waits for."""
        with self._lock:
            return [wait.what for wait in self._waits.values()]

    @property
    def reporting(self) -> bool:
        """Whether this process's watch thread is running (it starts with the first wait)."""
        return self._thread is not None and self._thread.is_alive()

    @contextlib.contextmanager
    def watching(self, what: str, hint: str = PEER_HINT, group: Any = UNKNOWN_PEERS) -> Iterator[None]:
        """Register a blocking wait in ``what`` while the block runs (from any thread); a warning about it says
        ``hint`` (what such a wait usually means: by default, a peer that has not made the matching call). For a
        collective over ``group`` (None: the world), the warning names the ranks it waits for."""
        if self.warn_after_s <= 0:
            yield
            return
        now = time.monotonic()
        entry = _Wait(what, hint, now, now + self.warn_after_s, group)
        with self._lock:
            self._waits[id(entry)] = entry
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shardkit-wait-watch", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                del self._waits[id(entry)]

    def _run(self) -> None:
        sleep_s = self.warn_after_s
        while True:
            # Until the next warning is due, so it comes at the age it reports. A wait registered while the thread
            # sleeps is due no sooner than one threshold from now, when the thread wakes anyway; switched off, it
            # looks every 5 s for a new threshold (a new one wakes it at once).
            self._wake.wait(sleep_s if self.warn_after_s > 0 else 5.0)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                due = [w for w in self._waits.values() if now >= w.next_warning]
                for wait in due:
                    wait.next_warning = wait.next_warning + REPEAT_S
                upcoming = [w.next_warning for w in self._waits.values()]
            sleep_s = max(0.0, min([now + max(self.warn_after_s, 0.0), *upcoming]) - now)
            for wait in due:
                logger.warning(
                    "%s has waited %.0f s so far in %s: %s",
                    _rank_name(),
                    now - wait.since,
                    wait.what,
                    _awaited(wait.group) if wait.hint is PEER_HINT else wait.hint,
                )


def _awaited(group: Any) -> str:
    """Who a collective over ``group`` waits for, and what that may mean (:data:`PEER_HINT` when unknown).

    In a group of two that is the other rank. In a larger one the ranks that arrived cannot be told from those
    that did not without a record per collective, which only the collective checks keep."""
    if group is UNKNOWN_PEERS or not (dist.is_available() and dist.is_initialized()):
        return PEER_HINT
    try:
        others = [r for r in dist.get_process_group_ranks(group or dist.group.WORLD) if r != dist.get_rank()]
    except Exception:  # the group was destroyed meanwhile
        return PEER_HINT
    if len(others) == 1:
        return f"rank {others[0]} has not made the matching call yet. {_LATE}"
    return (
        f"one or more of ranks {others} have not made the matching call yet (SHARDKIT_CHECK_COLLECTIVES=1 names "
        f"which). {_LATE}"
    )


def _rank_name() -> str:
    if dist.is_available() and dist.is_initialized():
        return f"rank {dist.get_rank()}"
    return "this process"


def _env_seconds() -> float:
    raw = os.environ.get(ENV_WARN_AFTER, "")
    try:
        return float(raw) if raw else DEFAULT_WARN_AFTER_S
    except ValueError:
        raise ValueError(f"{ENV_WARN_AFTER} must be a number of seconds, got {raw!r}") from None
