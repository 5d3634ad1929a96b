"""Labels and optional wall-clock timings for the phases of ``perform_slowmo`` (``profile_mode``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.profiler import record_function

logger = logging.getLogger("shardkit.nn.slowmo")


def configure_logging(verbose: bool, profile_mode: bool) -> None:
    """Make the requested logs visible: DEBUG for ``verbose``, INFO for ``profile_mode``.

    A stderr handler is added only when nothing would print them otherwise (no handler configured anywhere).
    """
    if not (verbose or profile_mode):
        return
    logger.setLevel(logging.DEBUG if verbose else min(logger.getEffectiveLevel(), logging.INFO))
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)


class PhaseTimer:
    """Wraps each phase in a profiler label and, when enabled, adds its wall time to :attr:`seconds`.

    Timing waits for the device to finish the phase's work (CUDA only), which costs some overlap: it is only
    switched on by ``profile_mode``.
    """

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label (and maybe time) the block as ``slowmo::<name>``."""
        with record_function(f"slowmo::{name}"):
            if not self.enabled:
                yield
                return
            self._sync()
            start = time.perf_counter()
            yield
            self._sync()
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def report(self, step: int) -> None:
        """Log the accumulated time per phase."""
        if self.enabled:
            parts = ", ".join(f"{k} {v * 1e3:.2f} ms/{self.calls[k]}" for k, v in sorted(self.seconds.items()))
            logger.info("slowmo step %d timings: %s", step, parts)
