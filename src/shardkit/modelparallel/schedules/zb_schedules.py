"""The pipeline simulator behind the zero-bubble schedules (Qi et al. 2024, arXiv 2401.10241): the checker of
their lists, the source of the bench's and the planner's theoretical bubbles, and a greedy reference builder.

The lists themselves are written out phase by phase in :mod:`~shardkit.modelparallel.pipeline.pipeline_parallel`
(warm-up forwards; then B, the W's due, F; then the cool-down's B's and W's; then the postponed W's), where
the argument that they cannot deadlock is given. This module checks them:

- :func:`simulate` runs any set of per-stage lists in simulated time (every stage runs its list in order,
  an ``F`` waiting for the activation from the stage before, a ``B`` for the gradient from the stage after)
  and raises if the stages would wait on each other forever. The tests run it on the written lists for many
  pipeline shapes and random action times.
- :func:`build_schedules` builds lists the other way, by simulation: with every action taking one unit,
  whenever a stage is free it starts the next ``B`` whose gradient has arrived, else the next ``F`` whose
  input has arrived if the stage holds fewer than its cap of micro-batches between F and W, else the oldest
  pending ``W``. The tests check the written lists are never slower than these under the same caps
  (:data:`ZB_CAPS`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol


class Op(NamedTuple):
    """One action of a built list: ``kind`` ``"F"``, ``"B"`` or ``"W"`` of micro-batch ``microbatch`` (the
    schedule module turns these into its ``Action``; kept apart so this module imports nothing of it)."""

    kind: str
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}"


class ActionLike(Protocol):
    """What :func:`simulate` reads of an action."""

    @property
    def kind(self) -> str: ...

    @property
    def microbatch(self) -> int: ...


Key = tuple[int, str, int]  # (stage, kind, micro-batch)


def zero_bubble_h1_hold(num_stages: int) -> int:
    """How many micro-batches ZB-H1 lets every stage hold between F and W: ``p - 1``, at least 2 (at most ``p``).

    Each one more takes ``F`` off every stage's idle time with equal F/B/W times (``hold = p``, the paper's
    bound, reaches ``(p-1)F``), and adds a micro-batch whose B has run to the later stages. On the bench LM
    (BENCHMARKS.md, "Zero-bubble phase lists") the largest stage's peak activation stays within 1.05x of
    1F1B's at 2 stages with ``hold = 2 = p`` (1.00x), but at 4 stages ``hold = 4`` gives 1.17x (its cut puts
    3 of 8 blocks on stage 2, which then holds 2 micro-batches whole and 2 after B, against the first stage's
    4 of 2 blocks and the embedding), and ``hold = 3`` stays within the bound.
    """
    return min(num_stages, max(2, num_stages - 1))


#: Schedule name -> cap of stage ``s`` of ``p``: micro-batches its written list holds between F and W at most.
ZB_CAPS = {
    "zero_bubble": lambda s, p: max(p - s, zero_bubble_h1_hold(p)),
    "zero_bubble_h2": lambda s, p: max(2 * (p - s) - 1, p),
}


@dataclass(frozen=True)
class Timeline:
    """A simulated run: per stage, ``(action, start, end)`` in execution order."""

    runs: tuple[tuple[tuple[ActionLike, float, float], ...], ...]

    @property
    def makespan(self) -> float:
        """When the last action ends."""
        return max(run[-1][2] for run in self.runs if run)

    def bubble(self, stage: int) -> float:
        """Fraction of the run ``stage`` spends idle."""
        busy = sum(end - start for _, start, end in self.runs[stage])
        return 1.0 - busy / self.makespan

    def mean_bubble(self) -> float:
        """The idle fraction averaged over the stages."""
        return sum(self.bubble(s) for s in range(len(self.runs))) / len(self.runs)


def _cost(costs: Optional[Sequence[Mapping[str, float]]], stage: int, kind: str, split: bool) -> float:
    table = costs[stage] if costs is not None else {"F": 1.0, "B": 1.0, "W": 1.0}
    if kind == "B" and not split:  # an unsplit backward does both halves
        return table["B"] + table["W"]
    return table[kind]


def simulate(
    schedules: Sequence[Sequence[ActionLike]], costs: Optional[Sequence[Mapping[str, float]]] = None
) -> Timeline:
    """Run every stage's list in simulated time (``costs[stage][kind]``, default 1 each; no link latency).

    ``F k`` on stage ``s`` waits for ``F k`` on ``s - 1``; ``B k`` waits for ``B k`` on ``s + 1``. A list
    without W actions is unsplit: its ``B`` costs ``B + W``. Raises ``RuntimeError`` if the lists deadlock.
    """
    p = len(schedules)
    split = [any(a.kind == "W" for a in actions) for actions in schedules]
    done: dict[Key, float] = {}
    runs: list[list[tuple[ActionLike, float, float]]] = [[] for _ in range(p)]
    free = [0.0] * p
    position = [0] * p
    while any(position[s] < len(schedules[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(schedules[s]):
                action = schedules[s][position[s]]
                ready = _ready_at(action, s, p, done)
                if ready is None:
                    break
                start = max(free[s], ready)
                free[s] = start + _cost(costs, s, action.kind, split[s])
                done[(s, action.kind, action.microbatch)] = free[s]
                runs[s].append((action, start, free[s]))
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: schedules[s][position[s]] for s in range(p) if position[s] < len(schedules[s])}
            raise RuntimeError(f"the schedules deadlock: stages wait on each other at {stuck}")
    return Timeline(tuple(tuple(run) for run in runs))


def _ready_at(action: ActionLike, stage: int, p: int, done: Mapping[Key, float]) -> Optional[float]:
    """When what ``action`` receives has arrived (None: its sender has not run it yet)."""
    if action.kind == "F" and stage > 0:
        return done.get((stage - 1, "F", action.microbatch))
    if action.kind == "B" and stage < p - 1:
        return done.get((stage + 1, "B", action.microbatch))
    return 0.0


@functools.lru_cache(maxsize=64)
def build_schedules(num_stages: int, microbatches: int, caps: tuple[int, ...]) -> tuple[tuple[Op, ...], ...]:
    """Every stage's action list of a zero-bubble schedule whose stage ``s`` holds at most ``caps[s]``
    micro-batches between F and W, built greedily in simulation (the module docstring gives the rule): the
    reference the written lists are tested against.

    Example::

        >>> build_schedules(2, 3, (2, 2))[1]
        (F0, B0, F1, B1, W0, W1, F2, B2, W2)
    """
    p, m = num_stages, microbatches
    state = _Greedy(p, m, caps)
    while not state.finished():
        waiting = sorted((s for s in range(p) if state.remaining(s)), key=lambda s: (state.free[s], s))
        if not any(state.start_next(s) for s in waiting if state.free[s] == state.free[waiting[0]]):
            state.wait(waiting[0])
    return tuple(tuple(a for a, _, _ in run) for run in state.runs)


class _Greedy:
    """The simulated pipeline :func:`build_schedules` drives, one decision per free stage."""

    def __init__(self, p: int, m: int, caps: tuple[int, ...]) -> None:
        self.p, self.m, self.caps = p, m, caps
        self.free = [0.0] * p
        self.next_f, self.next_b, self.next_w = [0] * p, [0] * p, [0] * p
        self.done: dict[Key, float] = {}
        self.runs: list[list[tuple[Op, float, float]]] = [[] for _ in range(p)]

    def remaining(self, s: int) -> bool:
        return self.next_w[s] < self.m

    def finished(self) -> bool:
        return not any(self.remaining(s) for s in range(self.p))

    def _arrived(self, s: int, action: Op) -> bool:
        at = _ready_at(action, s, self.p, self.done)
        return at is not None and at <= self.free[s]

    def start_next(self, s: int) -> bool:
        """Start the preferred action that can start now on stage ``s``; False when none can."""
        b, f, w = self.next_b[s], self.next_f[s], self.next_w[s]
        if b < f and self._arrived(s, Op("B", b)):
            self.next_b[s] += 1
            return self._run(s, Op("B", b))
        if f < self.m and f - w < self.caps[s] and self._arrived(s, Op("F", f)):
            self.next_f[s] += 1
            return self._run(s, Op("F", f))
        if w < b:
            self.next_w[s] += 1
            return self._run(s, Op("W", w))
        return False

    def _run(self, s: int, action: Op) -> bool:
        start, end = self.free[s], self.free[s] + 1.0
        self.free[s] = end
        self.done[(s, action.kind, action.microbatch)] = end
        self.runs[s].append((action, start, end))
        return True

    def wait(self, s: int) -> None:
        """Nothing can start now on the earliest stages: move their clocks to the next arrival."""
        now = self.free[s]
        later = [t for t in self.done.values() if t > now]
        later += [self.free[o] for o in range(self.p) if self.remaining(o) and self.free[o] > now]
        if not later:
            raise RuntimeError(f"zero-bubble schedule construction stalled at stage {s} (caps {self.caps})")
        for o in range(self.p):
            if self.free[o] == now:
                self.free[o] = min(later)
