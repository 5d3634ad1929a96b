"""``local_rehearsal()``: run code that issues collectives on one rank alone, with the right shapes.

smp partitions a model by tracing one forward on rank 0 alone, on the model's real layers. A layer split across
tensor-parallel ranks communicates in its forward (all-reduce, all-gather, reduce-scatter); traced alone it would
wait for peers that never come, and on the ``meta`` device (a delayed model) there is nothing to send. Inside
:func:`local_rehearsal` every labelled collective of :mod:`shardkit.distributed.collectives` issued by this thread
completes at once without communicating, as if each peer held this rank's tensor: an all-reduce, broadcast or reduce
leaves the tensor as it is, an all-gather repeats this rank's shard, a reduce-scatter keeps a chunk's worth. Shapes,
dtypes and devices are what a real run gives; values are not (a rehearsal measures work and sizes, never trains).

A ``ContextVar``: it applies to the thread that opened it only (autograd's device threads and other ranks are not
affected), and only while the block is open. The planner's :func:`shardkit.plan.peerless.peerless_world` gives the
same mirrored answers for a whole fake world without ``init_process_group``; a rehearsal is the switch for one
thread inside a real world, whose groups stay untouched for every other caller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_REHEARSING: ContextVar[bool] = ContextVar("shardkit_local_rehearsal", default=False)


@contextlib.contextmanager
def local_rehearsal() -> Iterator[None]:
    """Collectives issued by this thread inside complete locally, without communicating (see the module docstring).

    Example::

        with local_rehearsal():
            costs = trace_costs(tensor_parallel_model, (tokens,), {})   # rank 0 alone: no peer is waited for
    """
    token = _REHEARSING.set(True)
    try:
        yield
    finally:
        _REHEARSING.reset(token)


def rehearsing() -> bool:
    """Whether this thread is inside :func:`local_rehearsal`."""
    return _REHEARSING.get()
