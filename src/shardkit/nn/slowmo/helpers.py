"""Two small utilities fairscale's gossip package exported: ``communicate`` and ``CudaEventRecorder``.

Example::

    communicate(list(model.parameters()), functools.partial(dist.all_reduce, group=group))
    timer = CudaEventRecorder("forward"); out = model(x); timer.stop(); timer.find_time_elapsed()  # ms
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from shardkit.nn.slowmo.flat import groups_by_dtype


def communicate(
    tensors: Sequence[torch.Tensor], communication_op: Callable[..., Any], logger: Optional[logging.Logger] = None
) -> None:
    """Run ``communication_op(tensor=flat)`` once per dtype on a flat copy of ``tensors``, then copy the result back.

    ``communication_op`` is typically ``functools.partial(torch.distributed.all_reduce, group=...)``: one collective
    per dtype instead of one per tensor. ``logger`` gets a debug line per step.
    """
    for flat in groups_by_dtype(list(tensors)):
        buffer = flat.copy_to(flat.new_buffer(flat.tensors[0].dtype))
        if logger is not None:
            logger.debug("communicate: flattened %d tensors", len(flat.tensors))
        communication_op(tensor=buffer)
        flat.copy_from(buffer)
        if logger is not None:
            logger.debug("communicate: copied the result back")


class CudaEventRecorder:
    """Times a stretch of work from construction to :meth:`stop`, in milliseconds.

    On CUDA it records CUDA events (so it measures GPU time, not launch time); without CUDA it uses the host clock,
    so the same code runs on CPU. fairscale's class-level registry (``get_timings``, ``get_all_timings``,
    ``reset``) is not kept: SlowMo's phases are labelled for ``torch.profiler``, and ``profile_mode=True`` logs
    their timings.
    """

    def __init__(self, event_name: str) -> None:
        self.event_name = event_name
        self._cuda = torch.cuda.is_available()
        self._start: Any = self._now()
        self._end: Any = None

    def _now(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self) -> None:
        """Mark the end of the timed work."""
        self._end = self._now()

    def find_time_elapsed(self) -> float:
        """Milliseconds between construction and :meth:`stop` (waits for the GPU on CUDA)."""
        if self._end is None:
            raise RuntimeError(f"CudaEventRecorder {self.event_name!r}: call stop() before find_time_elapsed()")
        if self._cuda:
            self._end.synchronize()
            return float(self._start.elapsed_time(self._end))
        return (self._end - self._start) * 1000.0


__all__ = ["CudaEventRecorder", "communicate"]
