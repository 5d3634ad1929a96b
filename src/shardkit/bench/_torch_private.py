"""The private torch names ``shardkit.bench`` uses, reached here and nowhere else.

``shardkit bench pipeline`` counts what torch.distributed.pipelining's schedules send, and how long they wait on
receives, at the two module-level helpers of ``torch/distributed/pipelining/schedules.py`` every schedule's
point-to-point traffic goes through: ``_batch_p2p`` (posts a list of ``dist.P2POp``, returns their works; the
per-peer ``_sorted_batch_p2p`` calls it too) and ``_wait_batch_p2p`` (waits on such works). Both were checked on
torch 2.8.0, 2.11.0, 2.13.0 and 2.14.1 (CPU wheels, 2026-11-27). schedules.py looks them up as module globals at
each call, so replacing the module attributes for the length of a benchmark step reaches every schedule. Where a
release lacks either, :func:`pipelining_p2p` returns None and the bench prints "-" for what they would have
measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, Optional
from unittest import mock

P2PHelpers = tuple[Callable[..., Any], Callable[..., Any]]


def pipelining_p2p() -> Optional[P2PHelpers]:
    """torch's ``schedules._batch_p2p`` and ``schedules._wait_batch_p2p``, or None when this torch lacks either."""
    from torch.distributed.pipelining import schedules

    try:
        return schedules._batch_p2p, schedules._wait_batch_p2p
    except AttributeError:
        return None


@contextlib.contextmanager
def pipelining_p2p_replaced(batch: Callable[..., Any], wait: Callable[..., Any]) -> Iterator[None]:
    """Inside, torch's pipeline schedules call ``batch`` and ``wait`` instead of the two helpers (in this process
    only; restored on the way out, also on an error). Call only where :func:`pipelining_p2p` found them."""
    from torch.distributed.pipelining import schedules

    with mock.patch.multiple(schedules, _batch_p2p=batch, _wait_batch_p2p=wait):
        yield


def process_group_size(group_name: str) -> int:
    """The size of the process group torch's functional collectives name ``group_name`` (torch's private
    ``distributed_c10d._resolve_process_group``, checked on torch 2.13.0)."""
    from torch.distributed import distributed_c10d

    return int(distributed_c10d._resolve_process_group(group_name).size())  # type: ignore[arg-type]


__all__ = ["pipelining_p2p", "pipelining_p2p_replaced", "process_group_size"]
