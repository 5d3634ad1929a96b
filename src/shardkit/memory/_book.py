"""Bookkeeping of live tensor storages: their category and size, running totals, and the peak.

Each storage is counted once however many tensors view it, by the bytes it holds right now (a storage
resized to zero, like a freed FSDP full parameter, counts nothing). A weak reference per storage removes its
bytes when torch frees it, whichever thread drops the last reference, hence the lock. The memory tracker keeps one
book; the planner (``shardkit.plan``) keeps two, one for the device and one for host memory.
"""

from __future__ import annotations

import enum
import functools
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Optional

import torch


class Category(str, enum.Enum):
    """What a storage holds, as far as the tracker can tell (see :class:`~shardkit.memory.MemoryTracker`)."""

    #: Module parameters and buffers, including full parameters gathered by sharded data parallelism.
    PARAMETERS = "parameters"
    #: ``.grad`` of parameters, and full gradients waiting to be reduced.
    GRADIENTS = "gradients"
    #: Optimizer state (and the optimizer step's scratch while it runs).
    OPTIMIZER_STATE = "optimizer_state"
    #: Tensors created inside a module's forward (saved for backward, or not yet freed).
    ACTIVATIONS = "activations"
    #: Buffers made for a collective (the planner tells them apart; the tracker counts them as temporaries).
    COMM_BUFFERS = "comm_buffers"
    #: Everything else: gradients of activations during backward, communication buffers, scratch.
    TEMPORARIES = "temporaries"


@dataclass(frozen=True)
class MemorySnapshot:
    """Bytes per category at one moment."""

    by_category: Mapping[Category, int] = field(default_factory=lambda: dict.fromkeys(Category, 0))

    @property
    def total(self) -> int:
        """Bytes of every category together."""
        return sum(self.by_category.values())

    def __getitem__(self, category: Category) -> int:
        return self.by_category.get(category, 0)

    def format(self) -> str:
        """One line: the total, then each non-empty category (MiB)."""
        parts = [f"{c.value} {self[c] / 2**20:.1f}" for c in Category if self[c]]
        return f"total {self.total / 2**20:.1f} MiB ({', '.join(parts) or 'nothing'})"


class MemoryLimitExceeded(MemoryError):
    """A book grew past the limit it was given."""

    def __init__(self, needed: int, limit: int) -> None:
        super().__init__(f"needed more than {limit / 2**30:.1f} GiB (reached {needed / 2**30:.1f} GiB)")
        self.needed = needed
        self.limit = limit


class _Record:
    __slots__ = ("category", "nbytes", "ref")

    def __init__(self, category: Category, nbytes: int) -> None:
        self.category = category
        self.nbytes = nbytes
        self.ref: Optional[weakref.ref[torch.UntypedStorage]] = None


class StorageBook:
    """Live storages by category, with the current and peak totals.

    ``limit_bytes``: raise :class:`MemoryLimitExceeded` when a storage grows the total past it. ``on_peak``: called
    (under the book's lock) each time the total reaches a new peak, to note where it happened.
    """

    def __init__(self, limit_bytes: Optional[int] = None, on_peak: Optional[Callable[[], None]] = None) -> None:
        self.limit_bytes = limit_bytes
        self._on_peak = on_peak
        self._records: dict[int, _Record] = {}
        self._totals: dict[Category, int] = dict.fromkeys(Category, 0)
        self.current = 0
        self.peak = 0
        self._peak_totals: dict[Category, int] = dict(self._totals)
        # Re-entrant: a weakref callback (a storage freed by a garbage collection that a dict insert or
        # weakref.ref() under the lock happens to trigger) takes the lock again on the same thread.
        self._lock = threading.RLock()

    def track(self, storage: torch.UntypedStorage, category: Category, override: bool = False) -> None:
        """Count ``storage`` under ``category`` (or, if known, refresh its size; ``override`` re-labels it)."""
        key = id(storage)
        with self._lock:
            record = self._records.get(key)
            if record is None:
                record = _Record(category, 0)
                record.ref = weakref.ref(storage, functools.partial(self._forget_ref, key))
                self._records[key] = record
            elif override and record.category != category:
                self._totals[record.category] -= record.nbytes
                self._totals[category] += record.nbytes
                record.category = category
            self._resize(record, storage.nbytes())

    def resized(self, storage: torch.UntypedStorage, category: Category = Category.TEMPORARIES) -> None:
        """``storage`` changed size outside any operator (``UntypedStorage.resize_``); an unknown one is counted
        under ``category``."""
        with self._lock:
            record = self._records.get(id(storage))
            if record is not None:
                self._resize(record, storage.nbytes())
                return
        self.track(storage, category)

    def drop(self, storage: torch.UntypedStorage) -> Optional[Category]:
        """Stop counting ``storage`` (it moves to another book); its category, or None if not held here."""
        with self._lock:
            record = self._records.get(id(storage))
            if record is None:
                return None
            self._forget(id(storage))
            return record.category

    def category_of(self, storage: torch.UntypedStorage) -> Optional[Category]:
        """The category ``storage`` is counted under, or None if this book does not hold it."""
        record = self._records.get(id(storage))
        return record.category if record is not None else None

    def total(self, category: Category) -> int:
        """Bytes alive now under ``category``."""
        return self._totals[category]

    def _resize(self, record: _Record, nbytes: int) -> None:
        delta = nbytes - record.nbytes
        if delta:
            record.nbytes = nbytes
            self._totals[record.category] += delta
            self.current += delta
            if self.limit_bytes is not None and delta > 0 and self.current > self.limit_bytes:
                raise MemoryLimitExceeded(self.current, self.limit_bytes)
            if self.current > self.peak:
                self.peak = self.current
                self._peak_totals = dict(self._totals)
                if self._on_peak is not None:
                    self._on_peak()

    def _forget_ref(self, key: int, _ref: object) -> None:
        self._forget(key)

    def _forget(self, key: int) -> None:
        with self._lock:
            record = self._records.pop(key, None)
            if record is not None:
                self._totals[record.category] -= record.nbytes
                self.current -= record.nbytes

    def snapshot(self) -> MemorySnapshot:
        with self._lock:
            return MemorySnapshot(dict(self._totals))

    def peak_snapshot(self) -> MemorySnapshot:
        with self._lock:
            return MemorySnapshot(dict(self._peak_totals))

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        with self._lock:
            self.peak = self.current
            self._peak_totals = dict(self._totals)
