"""The root's schedule: the order units ran in and the gathers issued ahead of use.

Execution order is recorded every forward: *pre-forward* order (which unit starts next) drives forward
prefetch, which therefore begins at the second step; the reverse of *post-forward* order is the order
backward visits units (the root's head first, then the last block, ...), which drives backward prefetch::

    forward:   root | b0 | b1 | ... | b7 | (root's head)      pre-forward order  root, b0, ..., b7
    backward:  (root's head) | b7 | b6 | ... | b0 | root    reversed post-forward order root, b7, ..., b0

A prefetch issues the next unit's all-gather early and only that; at most ``limit`` units are gathered ahead of
their use at once (the rate limit), so prefetching raises peak memory by at most that many units' full
parameters. Decisions depend only on the recorded order, which every rank shares, so every rank issues the
same collectives in the same order. The reductions in flight are queued in
:class:`~shardkit.nn.fsdp.reduce.ReduceQueue`, beside the code that starts them.

The schedule knows units only through :class:`Prefetchable` (their parameter group and a way to start their
gather), so it imports nothing from the runtime that drives it.
"""

from __future__ import annotations

from typing import Generic, Optional, Protocol, TypeVar

from shardkit.nn.fsdp.param_group import ParamGroup


class Prefetchable(Protocol):
    """What the schedule needs of a unit (:class:`~shardkit.nn.fsdp.runtime.Unit` provides it)."""

    @property
    def group(self) -> ParamGroup: ...

    def prefetch_unshard(self) -> None:
        """Start gathering the unit's parameters ahead of its use."""


Unit = TypeVar("Unit", bound=Prefetchable)


class Schedule(Generic[Unit]):
    """Owned by the root unit; shared by every unit of its tree."""

    def __init__(self, limit: int = 1) -> None:
        #: Units gathered ahead of use at once, at most.
        self.limit = limit
        #: This forward's units (by id) in the order they started and finished, each once.
        self._pre_order: dict[int, Unit] = {}
        self._post_order: dict[int, Unit] = {}
        #: Previous forward's pre-forward successor of each unit (forward prefetch).
        self._forward_next: dict[int, Unit] = {}
        #: This forward's backward successor of each unit (backward prefetch), built on first use.
        self._backward_next: Optional[dict[int, Unit]] = None
        self.prefetched: list[Unit] = []

    # ------------------------------------------------------------------ execution order
    def begin_forward(self) -> None:
        """The root starts a forward: the last recorded order becomes the forward-prefetch plan."""
        if self._pre_order:
            order = list(self._pre_order.values())
            self._forward_next = {id(a): b for a, b in zip(order, order[1:])}
        self._pre_order, self._post_order = {}, {}
        self._backward_next = None

    def record_pre_forward(self, unit: Unit) -> None:
        self._pre_order.setdefault(id(unit), unit)

    def record_post_forward(self, unit: Unit) -> None:
        if id(unit) not in self._post_order:
            self._post_order[id(unit)] = unit
            self._backward_next = None

    def next_in_forward(self, unit: Unit) -> Optional[Unit]:
        """The unit that started after ``unit`` in the previous forward (None at the first step)."""
        return self._forward_next.get(id(unit))

    def next_in_backward(self, unit: Unit) -> Optional[Unit]:
        """The unit backward visits after ``unit`` in this step."""
        if self._backward_next is None:
            order = list(self._post_order.values())[::-1]
            self._backward_next = {id(a): b for a, b in zip(order, order[1:])}
        return self._backward_next.get(id(unit))

    # ------------------------------------------------------------------ prefetch (rate limited)
    def prefetch(self, unit: Optional[Unit]) -> None:
        """Start gathering ``unit``'s parameters ahead of its use, unless already gathered or over the limit."""
        if unit is None or unit.group.is_unsharded() or len(self.prefetched) >= self.limit:
            return
        unit.prefetch_unshard()
        self.prefetched.append(unit)

    def consume(self, unit: Unit) -> None:
        """``unit`` started using its (possibly prefetched) parameters."""
        if self.prefetched and unit in self.prefetched:
            self.prefetched.remove(unit)

    def release_unused(self) -> None:
        """Free prefetched parameters nobody used (the order changed, or forward ended without using them)."""
        for unit in self.prefetched:
            unit.group.reshard()
        self.prefetched.clear()
