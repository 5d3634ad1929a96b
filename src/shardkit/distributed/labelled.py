"""What every shardkit collective goes through: a label, the comm meter, the simulated link, a handle.

:func:`custom_collective` issues one operation under ``torch.profiler.record_function``
(``shardkit::<op>:<label>``), records its bytes with an active :class:`CommMeter` (split into intra- and
inter-node by :mod:`shardkit.distributed.node_traffic`), delays its completion under an active
:func:`comm_delay`, and returns a :class:`Handle`. The wrappers in :mod:`shardkit.distributed.collectives` are
built on it; strategies use it directly for hand-built exchanges. Kept apart from the wrappers so the machinery
(metering, delays, failure reports) reads in one place and the wrappers only say what they send.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardkit.distributed.departures import DEPARTURES
from shardkit.distributed.groups import GroupLike
from shardkit.distributed.health import explain_failure, verify_matching
from shardkit.distributed.instrumentation import INSTRUMENTATION, CommMeter, LinkModel
from shardkit.distributed.long_waits import UNKNOWN_PEERS
from shardkit.distributed.node_traffic import inter_node_share


@contextlib.contextmanager
def count_comm_bytes(meter: Optional[CommMeter] = None) -> Iterator[CommMeter]:
    """Count the bytes of every shardkit collective issued inside the block.

    The meter is registered process-wide when the block opens, so collectives issued on other threads while it
    is open (autograd's backward hooks on CUDA run on device threads) are counted too.

    Example::

        with count_comm_bytes() as meter:
            train_step()
        print(meter.total_wire_bytes)
    """
    with INSTRUMENTATION.meters.opened(meter if meter is not None else CommMeter()) as active:
        yield active


@contextlib.contextmanager
def comm_delay(latency_s: float = 0.0, bytes_per_s: Optional[float] = None, scope: str = "all") -> Iterator[None]:
    """Simulate a slow network for shardkit collectives issued inside the block.

    Each collective completes no earlier than ``latency_s + wire_bytes / bytes_per_s`` after the link is
    free. Asynchronous collectives keep running in the background, so the delay overlaps with computation
    exactly as a real slow link would; only ``wait()`` blocks. Like :func:`count_comm_bytes`, the link applies
    to collectives issued on any thread while the block is open.

    ``scope="inter_node"`` simulates a slow network between nodes only: collectives that stay inside a node are
    not slowed, the others take ``latency_s + inter_node_bytes / bytes_per_s`` (their bytes that cross nodes,
    as the comm meter counts them; see :mod:`shardkit.distributed.node_traffic`). Both kinds can be open at
    once; a collective then waits for the later of the two.

    Example::

        with comm_delay(0.005, 100e6, scope="inter_node"):   # 5 ms, 100 MB/s between nodes
            train_step()
    """
    if scope not in ("all", "inter_node"):
        raise ValueError(f"comm_delay scope must be 'all' or 'inter_node', got {scope!r}")
    stack = INSTRUMENTATION.links if scope == "all" else INSTRUMENTATION.inter_links
    with stack.opened(LinkModel(latency_s, bytes_per_s)):
        yield


class Handle:
    """A pending collective. ``wait()`` blocks until it has completed (and its simulated delay elapsed)."""

    def __init__(
        self, work: Optional[Any] = None, ready_at: float = 0.0, what: str = "", group: Any = UNKNOWN_PEERS
    ) -> None:
        self._work = work
        self._ready_at = ready_at
        self._what = what
        self._group = group  # whose members a long wait names (None: the world)

    def wait(self) -> None:
        if self._work is not None:
            try:
                with INSTRUMENTATION.waits.watching(self._what or "a collective", group=self._group):
                    self._work.wait()
            except Exception as err:
                raise explain_failure(err, self._what) from err
            self._work = None
        remaining = self._ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        self._ready_at = 0.0

    def is_completed(self) -> bool:
        done = self._work is None or bool(self._work.is_completed())
        return done and time.perf_counter() >= self._ready_at


class Works:
    """Several torch works (point-to-point sends and receives) completed as one, then an optional local step.

    The ``run`` of :func:`custom_collective` returns one of these for hand-built exchanges; ``then`` runs once,
    after every work has finished (for example summing what arrived).
    """

    def __init__(self, works: list[Any], then: Optional[Callable[[], Any]] = None) -> None:
        self._works = works
        self._then = then

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        self._works = []
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor``'s elements occupy (what a collective moves per copy of it)."""
    return tensor.numel() * tensor.element_size()


def custom_collective(
    op: str,
    label: str,
    tensor: torch.Tensor,
    group: GroupLike,
    wire_bytes: float,
    async_op: bool,
    run: Callable[[], Any],
    pattern: str = "ring",
    root_in_group: int = 0,
    peer: Optional[int] = None,
) -> Handle:
    """Issue a collective that shardkit does not wrap itself, with the same labelling, metering and checks.

    ``run`` starts the operation asynchronously and returns its torch work handle (or None). ``tensor`` is the
    buffer whose size and dtype identify the call (checked across ranks in debug mode); ``wire_bytes`` is what
    the :class:`CommMeter` records as sent per rank. Strategies use this for hand-built exchanges (for example
    send/recv rings) so they still show up in profiles, byte counts and :func:`comm_delay`. ``pattern`` (with
    ``root_in_group`` for ``"rooted"`` and the peer's global rank ``peer`` for ``"p2p"``) names the traffic
    model that splits the bytes into intra- and inter-node (:mod:`shardkit.distributed.node_traffic`).
    """
    DEPARTURES.watch()  # from the first collective on, how this process ends is recorded for its peers
    verify_matching(group, op, label, tensor)
    meter = INSTRUMENTATION.meters.top
    link = INSTRUMENTATION.links.top
    inter_link = INSTRUMENTATION.inter_links.top
    inter_bytes = 0.0
    if (meter is not None or inter_link is not None) and wire_bytes > 0:
        inter_bytes = wire_bytes * _inter_share(group, pattern, root_in_group, peer)
    if meter is not None:
        meter.record(op, tensor_nbytes(tensor), wire_bytes, inter_bytes)
    ready_at = link.finish_time(wire_bytes) if link is not None else 0.0
    if inter_link is not None and inter_bytes > 0:
        ready_at = max(ready_at, inter_link.finish_time(inter_bytes))
    name = f"shardkit::{op}:{label}" if label else f"shardkit::{op}"
    with record_function(name):
        try:
            work = run()
        except Exception as err:
            raise explain_failure(err, name) from err
    if peer is None:
        handle = Handle(work, ready_at, name, group if isinstance(group, dist.ProcessGroup) else UNKNOWN_PEERS)
    else:
        handle = Handle(work, ready_at, f"{name} with rank {peer}")
    if not async_op:
        handle.wait()
    return handle


def _inter_share(group: GroupLike, pattern: str, root_in_group: int, peer: Optional[int]) -> float:
    """The share of a collective's bytes that crosses nodes (0 for a dummy group: nothing is sent)."""
    if not isinstance(group, dist.ProcessGroup):
        return 0.0
    if pattern == "p2p":
        return inter_node_share([dist.get_rank()], "p2p", 0, peer)
    return inter_node_share(dist.get_process_group_ranks(group), pattern, root_in_group)
