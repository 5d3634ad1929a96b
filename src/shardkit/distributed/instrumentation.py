"""Process-wide instrumentation of shardkit's collectives: comm meters, simulated slow links, collective checks.

Why not ``contextvars``: on CUDA, autograd runs backward hooks on its own device threads, which do not see the
caller's ``ContextVar`` values, so a meter held in one would silently miss every collective issued from a
backward hook (gradient reductions, FSDP's re-gathers). The scopes (:func:`~shardkit.distributed.count_comm_bytes`,
:func:`~shardkit.distributed.comm_delay`, :func:`~shardkit.distributed.check_collectives`) therefore capture their
meter, link or check state when they open and register it in one process-wide :class:`Instrumentation` object;
a collective issued on any thread while the scope is open sees it. Scopes nest: the innermost open one of each kind
is active. Everything a collective updates (byte counters, the link's busy time, sequence numbers) is locked, as
several threads may issue collectives at once. The node layout the meter and the inter-node link use is set once
per process (:func:`~shardkit.distributed.set_topology`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Optional, TypeVar

from torch.profiler import record_function

from shardkit.distributed.departures import DEPARTURES
from shardkit.distributed.long_waits import UNKNOWN_PEERS, WaitWatch
from shardkit.distributed.node_layout import NodeLayout

T = TypeVar("T")


@dataclass
class CommMeter:
    """Counts what collectives move while it is active (see :func:`~shardkit.distributed.count_comm_bytes`).

    ``payload_bytes`` is the size of the buffers handed to collectives; ``wire_bytes`` estimates the bytes the
    whole group puts on the wire divided by the number of ranks (what one rank sends, on average):
    ``2(n-1)/n`` of the buffer for a ring all-reduce, ``(n-1)/n`` of the full buffer for all-gather,
    reduce-scatter, reduce and broadcast (each non-root rank's data crosses the wire once), the whole buffer
    for point-to-point sends. Recording is thread-safe: collectives issued from autograd's threads count too.

    ``inter_node_bytes`` is the part of ``wire_bytes`` that crosses between nodes and ``intra_node_bytes`` the
    rest, by the model in :mod:`shardkit.distributed.node_traffic` (a ring over the group's ranks: ``c / g`` of
    the bytes cross nodes when ``c`` of its ``g`` links join two nodes). Nodes come from
    :func:`~shardkit.distributed.set_topology`, else from torchrun's ``LOCAL_WORLD_SIZE``.
    """

    #: Bytes of the buffers handed to collectives, per op name.
    payload_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: Estimated bytes this rank sends, per op name.
    wire_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: Estimated bytes this rank sends to ranks on its own node, per op name.
    intra_node_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: Estimated bytes this rank sends to other nodes, per op name.
    inter_node_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: Number of collectives issued, per op name.
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: Guards the counters against collectives recorded from several threads at once.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, op: str, nbytes: int, wire: float, inter_node: float = 0.0) -> None:
        """Count one collective ``op``: ``nbytes`` payload, ``wire`` estimated bytes sent, ``inter_node`` of them
        crossing nodes."""
        wire_int = int(wire)
        inter_int = min(int(inter_node), wire_int)
        with self.lock:
            self.payload_bytes[op] += nbytes
            self.wire_bytes[op] += wire_int
            self.inter_node_bytes[op] += inter_int
            self.intra_node_bytes[op] += wire_int - inter_int
            self.calls[op] += 1

    @property
    def total_wire_bytes(self) -> int:
        """Estimated bytes this rank sent, over every op."""
        with self.lock:
            return sum(self.wire_bytes.values())

    @property
    def total_inter_node_bytes(self) -> int:
        """Estimated bytes this rank sent to other nodes, over every op."""
        with self.lock:
            return sum(self.inter_node_bytes.values())

    @property
    def total_intra_node_bytes(self) -> int:
        """Estimated bytes this rank sent inside its node, over every op."""
        with self.lock:
            return sum(self.intra_node_bytes.values())

    @property
    def total_payload_bytes(self) -> int:
        """Bytes handed to collectives, over every op."""
        with self.lock:
            return sum(self.payload_bytes.values())

    def reset(self) -> None:
        """Forget everything counted so far."""
        with self.lock:
            self.payload_bytes.clear()
            self.wire_bytes.clear()
            self.intra_node_bytes.clear()
            self.inter_node_bytes.clear()
            self.calls.clear()


@dataclass
class LinkModel:
    """A simulated slow link: fixed latency per collective plus bytes / bandwidth, one transfer at a time."""

    #: Fixed cost of every collective, in seconds.
    latency_s: float
    #: Bandwidth in bytes per second, or None for no bandwidth cap.
    bytes_per_s: Optional[float]
    #: ``time.perf_counter()`` at which the last scheduled transfer finishes.
    busy_until: float = 0.0
    #: Guards ``busy_until`` against transfers scheduled from several threads at once.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.latency_s < 0 or (self.bytes_per_s is not None and self.bytes_per_s <= 0):
            raise ValueError("comm_delay needs latency_s >= 0 and bytes_per_s > 0 (or None for no bandwidth cap)")

    def finish_time(self, nbytes: float) -> float:
        """Schedule a transfer of ``nbytes`` and return when it completes (``time.perf_counter()`` clock)."""
        cost = self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)
        with self.lock:
            start = max(time.perf_counter(), self.busy_until)
            self.busy_until = start + cost
            return self.busy_until


@dataclass
class CheckState:
    """The state of one :func:`~shardkit.distributed.check_collectives` scope: its timeout and sequence numbers."""

    #: Seconds each rank waits for the others' fingerprint before reporting where every rank is.
    timeout_s: float
    #: Collectives checked so far, per process group (keyed by the group's ``id``).
    sequence: dict[int, int] = field(default_factory=dict)
    #: Guards ``sequence`` against collectives checked from several threads at once.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"check_collectives needs timeout_s > 0, got {self.timeout_s}")

    def next_seq(self, group: Any) -> int:
        """The sequence number of the next collective checked on ``group`` (1 for the first)."""
        key = id(group)
        with self.lock:
            self.sequence[key] = self.sequence.get(key, 0) + 1
            return self.sequence[key]


class ScopeStack(Generic[T]):
    """The open scopes of one kind, innermost last; readable from any thread without locking.

    Opening and closing replace an immutable tuple (and the innermost entry, :attr:`top`) under a lock, so a
    reader sees either the old or the new state and never a half-updated list; reading :attr:`top` on every
    collective costs one attribute lookup.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: tuple[T, ...] = ()
        #: The innermost open scope's value, or None when none is open.
        self.top: Optional[T] = None

    def current(self) -> Optional[T]:
        """The innermost open scope's value, or None when none is open (the same as :attr:`top`)."""
        return self.top

    @contextlib.contextmanager
    def opened(self, value: T) -> Iterator[T]:
        """Make ``value`` the innermost active one of its kind while the block runs, for every thread."""
        with self._lock:
            self._open = (*self._open, value)
            self.top = value
        try:
            yield value
        finally:
            with self._lock:
                # Remove this scope's own entry (the last identical one): scopes opened on different threads
                # need not close in the order they opened.
                entries = list(self._open)
                for i in range(len(entries) - 1, -1, -1):
                    if entries[i] is value:
                        del entries[i]
                        break
                self._open = tuple(entries)
                self.top = entries[-1] if entries else None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


class Instrumentation:
    """Everything about collectives that is process-wide: the open meters, links and checks.

    One instance per process (:data:`INSTRUMENTATION`); the public scopes in :mod:`shardkit.distributed` open
    and close entries in it. ``SHARDKIT_CHECK_COLLECTIVES=1`` turns collective checks on for the whole process
    (timeout ``SHARDKIT_CHECK_TIMEOUT``, default 60 s) when no :func:`check_collectives` scope is open.
    """

    def __init__(self) -> None:
        #: Open :func:`count_comm_bytes` scopes.
        self.meters: ScopeStack[CommMeter] = ScopeStack()
        #: Open :func:`comm_delay` scopes that slow every collective.
        self.links: ScopeStack[LinkModel] = ScopeStack()
        #: Open ``comm_delay(..., scope="inter_node")`` scopes: they slow only the bytes that cross nodes.
        self.inter_links: ScopeStack[LinkModel] = ScopeStack()
        #: Which ranks share a node (:func:`~shardkit.distributed.set_topology`); None: from the environment.
        self.node_layout: Optional[NodeLayout] = None
        #: Open :func:`check_collectives` scopes.
        self.checks: ScopeStack[CheckState] = ScopeStack()
        # Read once, here: every collective asks for the active checks.
        timeout_s = float(os.environ.get("SHARDKIT_CHECK_TIMEOUT", "60"))
        #: The process-wide checks ``SHARDKIT_CHECK_COLLECTIVES=1`` asks for, else None.
        self.env_checks = CheckState(timeout_s) if _env_flag("SHARDKIT_CHECK_COLLECTIVES") else None
        #: The blocking waits in progress, and the thread that reports the long ones.
        self.waits = WaitWatch()

    def active_checks(self) -> Optional[CheckState]:
        """The innermost open check scope, else the process-wide one the environment asks for, else None."""
        state = self.checks.top
        return state if state is not None else self.env_checks


#: The process's one :class:`Instrumentation`.
INSTRUMENTATION = Instrumentation()


@contextlib.contextmanager
def blocking_call(name: str, group: Any = UNKNOWN_PEERS) -> Iterator[None]:
    """A torch call that blocks until every rank of ``group`` makes it (object collectives, the barrier): labelled
    ``name`` in profiles, and watched, so a rank blocked in it long says so, naming the ranks of ``group`` it waits
    for (:mod:`.long_waits`)."""
    DEPARTURES.watch()
    with record_function(name), INSTRUMENTATION.waits.watching(name, group=group):
        yield


__all__ = ["INSTRUMENTATION", "CheckState", "CommMeter", "Instrumentation", "LinkModel", "ScopeStack", "blocking_call"]
