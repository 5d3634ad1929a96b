"""Record the waits that ``comm_delay`` adds, so tests can assert where the simulated link blocked (in the call
that issued a collective, or in its ``wait``) by counting sleeps instead of reading wall-clock windows, which
stretch when the machine is loaded."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from types import SimpleNamespace
from unittest import mock

from shardkit.distributed import labelled


@contextlib.contextmanager
def link_sleeps() -> Iterator[list[float]]:
    """Yield the list of every simulated-link sleep (in seconds) requested inside the block."""
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    with mock.patch.object(labelled, "time", SimpleNamespace(perf_counter=time.perf_counter, sleep=sleep)):
        yield slept
