"""How each rank left the job, written where the ranks it left behind can read it: the process group's store.

When a rank's process ends, its gloo connections close and every rank still in a collective with it reads "Connection
closed by peer ... typically caused by a remote worker crashing", whether it crashed or simply finished (a rank with
fewer batches than the others). Here each process, from its first shardkit collective on, records in the store how it
ends: ``failed`` with its exception (an uncaught one, through ``sys.excepthook``, or one the launcher harness caught),
or ``left`` when the interpreter exits without one (``atexit``). The ranks left behind read those records to say
which rank went and how (:func:`~shardkit.distributed.health.explain_failure`).

Under torchrun the store handle is kept from the first collective on, so a script that destroys its process group
(at its end, or in a ``finally`` before the exception reaches ``sys.excepthook``) still reports; elsewhere the peers
then read that a rank left, finished or died. Keys carry torchrun's restart count: a restarted job
reusing the agent's store never reads the records of the round before. Costs nothing per collective after the first
(one attribute test); the records are a store write at exit and a few reads on the failure path only.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from types import TracebackType
from typing import Callable, Optional

import torch.distributed as dist

from shardkit.distributed._torch_private import default_store as torch_default_store

_PREFIX = "shardkit/health"
#: The record of a process that exited with no exception reported.
_LEFT = "its process exited without raising an error (its script finished, or called sys.exit)"
#: Seconds a rank that lost a peer waits for the peer's record: an exception hook or exit handler runs just after
#: the connections close when the script destroyed its process group first.
RECORD_WAIT_S = 5.0


def default_store() -> Optional[dist.Store]:
    """The key-value store the default process group rendezvoused through, or None without one.

    shardkit keeps small out-of-band records there (failed ranks, where each rank last was) that must be
    readable while collectives hang. torch exposes the store only privately; this is the one place that asks.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return torch_default_store()
    except Exception:
        return None


def _key(kind: str, rank: int) -> str:
    return f"{_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{kind}/{rank}"


def read_record(store: dist.Store, key: str) -> Optional[str]:
    """The text stored under ``key``, or None when there is none (or the store cannot be reached)."""
    with contextlib.suppress(Exception):
        if store.check([key]):
            return store.get(key).decode(errors="replace")
    return None


def _nothing() -> Optional[dist.Store]:
    return None


def _keep(store: dist.Store) -> Callable[[], Optional[dist.Store]]:
    """How this process reaches ``store`` once the script has destroyed its process group (to report at exit).

    torchrun's agent hosts the store its workers share (``TORCHELASTIC_USE_AGENT_STORE``), so a worker keeps its
    client: the record then reaches the others even after ``destroy_process_group()``. Any other store may be served
    by this very process, whose port a later ``init_process_group`` must be able to bind again: only a weak reference
    is kept, and a store torch let go of is not written to."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return lambda: store
    return weakref.ref(store)


class Departures:
    """This process's record of how it ends, and the other ranks' records (one per process: :data:`DEPARTURES`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: Callable[[], Optional[dist.Store]] = _nothing
        self._rank = 0
        self._watching = False
        self._reported = False
        os.register_at_fork(after_in_child=self._forget)  # a forked worker is a new rank with its own record

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._kept, self._rank, self._watching, self._reported = _nothing, 0, False, False

    def watch(self) -> None:
        """From now on, record in the store how this process ends (once per process; cheap to call again)."""
        if self._watching:
            return
        store = default_store()
        if store is None:
            return
        with self._lock:
            if self._watching:
                return
            self._kept, self._rank, self._watching = _keep(store), dist.get_rank(), True
        previous = sys.excepthook

        def hook(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
            self.report_failure(value)
            previous(kind, value, tb)

        sys.excepthook = hook
        atexit.register(self._exiting)

    def _current_store(self) -> tuple[Optional[dist.Store], int]:
        store = default_store()
        if store is not None:
            return store, dist.get_rank()
        return self._kept(), self._rank

    def report_failure(self, error: BaseException) -> None:
        """Record that this rank failed with ``error`` (best effort, never raises)."""
        store, rank = self._current_store()
        if store is None:
            return
        self._reported = True
        with contextlib.suppress(Exception):
            store.set(_key("failed", rank), f"{type(error).__name__}: {error}"[:2000])

    def _exiting(self) -> None:
        store, rank = self._current_store()
        if store is not None and not self._reported:
            with contextlib.suppress(Exception):
                store.set(_key("left", rank), _LEFT)

    def records(self, kind: str) -> dict[int, str]:
        """The other ranks' records of ``kind`` (``"failed"`` or ``"left"``), by rank."""
        store = default_store()
        if store is None:
            return {}
        found = {}
        for rank in range(dist.get_world_size()):
            message = read_record(store, _key(kind, rank))
            if message is not None:
                found[rank] = message
        return found

    def await_records(self, timeout_s: float = RECORD_WAIT_S) -> tuple[dict[int, str], dict[int, str]]:
        """The failed and the departed ranks' records, waiting up to ``timeout_s`` for the first to appear."""
        deadline = time.monotonic() + timeout_s
        while True:
            failed, left = self.records("failed"), self.records("left")
            left.pop(dist.get_rank() if dist.is_initialized() else -1, None)
            if failed or left or time.monotonic() >= deadline:
                return failed, left
            time.sleep(0.05)


#: The process's one :class:`Departures`.
DEPARTURES = Departures()


def lost_a_peer(error: BaseException) -> bool:
    """Whether ``error`` says a peer's connection closed (the peer's process ended), by gloo's or NCCL's words."""
    text = str(error).lower()
    return any(
        words in text
        for words in ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited")
    )


__all__ = ["DEPARTURES", "RECORD_WAIT_S", "Departures", "default_store", "lost_a_peer", "read_record"]
