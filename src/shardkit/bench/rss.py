"""Resident memory (RSS) of this process: now, and the peak rise during a block of code (Linux ``/proc``).

Example::

    with PeakRSS() as peak:
        save_checkpoint(path, step=step, model=model, optimizer=optimizer)
    print(peak.rise)  # bytes above the RSS just before the block
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from typing import Any, Optional


def current_rss() -> int:
    """This process's resident memory in bytes."""
    return _status_kib("VmRSS")


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def _release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``), so RSS before a phase counts only live
    memory: without it a phase could reuse what an earlier one freed and show no rise at all."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: a rise may then understate such a phase
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRSS:
    """The peak rise of this process's RSS during a ``with`` block, in bytes (``rise``).

    Before the block, freed heap memory is handed back to the OS so the starting RSS counts live memory only; the
    peak is the kernel's high-water mark, reset at the start through ``/proc/self/clear_refs``, together with a
    2 ms sampling thread (the only source where the reset is not allowed).
    """

    def __init__(self) -> None:
        self.rise = 0
        self._stop = threading.Event()
        self._sampled = 0
        self._thread: Optional[threading.Thread] = None
        self._use_hwm = False

    def __enter__(self) -> PeakRSS:
        _release_free_memory()
        self.before = _status_kib("VmRSS")
        try:  # "5" resets the high-water mark to the current RSS (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._use_hwm = _status_kib("VmHWM") <= self.before + 4 * 1024**2
        except OSError:
            self._use_hwm = False
        self._sampled = self.before
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._sampled = max(self._sampled, _status_kib("VmRSS"))

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        peak = max(self._sampled, _status_kib("VmHWM") if self._use_hwm else 0, _status_kib("VmRSS"))
        self.rise = max(0, peak - self.before)
