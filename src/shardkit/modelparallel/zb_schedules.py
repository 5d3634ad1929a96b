"""Zero-bubble pipeline schedules (Qi et al. 2024, arXiv 2401.10241), built by simulating the pipeline.

Each micro-batch's backward is split into ``B`` (the stage's input gradients, sent upstream at once) and ``W``
(its parameters' gradients, which need nothing from another stage and so can run whenever the stage would
otherwise wait). The schedules differ only in how many micro-batches a stage may hold at once, from the
start of its ``F`` to the end of its ``W`` (its *cap*):

- ZB-H1 (``"zero_bubble"``): stage ``s`` holds at most ``p - s`` micro-batches, exactly 1F1B's count on that
  stage, so no stage keeps more activations than under 1F1B. The steady state is ``F B W``; the cool-down
  moves each ``W`` into the wait for the next gradient. The critical path then loses one ``W`` per hop:
  the bubble drops from 1F1B's ``(p-1)(F+B+W)`` to ``(p-1)(F+B)`` per stage and cannot go lower, because the
  last stage (cap 1) must finish each ``W`` before its next ``F``.
- ZB-H2 (``"zero_bubble_h2"``): stage ``s`` holds at most ``max(2(p - s) - 1, p)`` micro-batches: the first
  stage ``2p - 1`` (1F1B's peak is ``p`` there, so about twice the activation memory of the largest 1F1B
  stage when stages' activations are alike), no stage more than the first. The warm-up runs more forwards
  and every stage, the last included, can postpone its ``W``'s into the remaining waits. With equal ``F``,
  ``B`` and ``W`` times its bubble is ``(p-1)F`` per stage, the time the last stage waits for the first
  activation, which no schedule avoids (so ``(p-1)/(3m+p-1)`` of the step). Fewer slots (``2(p - s)``
  everywhere, i.e. at most twice each stage's own 1F1B count) leave the last stage unable to postpone
  enough ``W``'s and the bubble at about 0.6x 1F1B's at 4 stages.

How the lists are built. :func:`build_schedules` runs the pipeline in simulated time with every action
taking one unit and no link latency. Whenever a stage is free it starts, in this order of preference, the
next ``B`` whose gradient has arrived, the next ``F`` whose input has arrived if it is under its cap, and
otherwise the oldest pending ``W``; with nothing to start it waits for the next arrival. The order each stage
ran its actions in is its list. Real runs reuse that order whatever the actual times.

Why they cannot deadlock. The lists come from one complete run of the simulation, in which every action
started after its own stage's previous action and after the actions on other stages it receives from. So
the start times order all actions consistently with both kinds of dependency: the dependency graph has no
cycle, and in any real run, whatever the durations, the earliest unfinished action in that order has
everything it waits for and can run (only receives wait: a send returns at once under gloo, and under NCCL
it is posted with the sender's next receive or right after B, see ``pp_communications``). :func:`simulate`
checks exactly this for any set of lists (it raises on a cycle), which the tests run for many pipeline
shapes.
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

#: Schedule name -> cap of stage ``s`` of ``p``: micro-batches it may hold between their F and their W.
ZB_CAPS = {
    "zero_bubble": lambda s, p: p - s,
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
    micro-batches between F and W (see the module docstring for the rule and why it cannot deadlock)."""
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


def zero_bubble_schedule(pipeline: str, stage: int, num_stages: int, microbatches: int) -> list[Op]:
    """The actions of ``stage`` under the zero-bubble ``pipeline`` (a key of :data:`ZB_CAPS`).

    Example::

        >>> zero_bubble_schedule("zero_bubble", 1, 2, 3)
        [F0, B0, W0, F1, B1, W1, F2, B2, W2]
    """
    cap = ZB_CAPS[pipeline]
    caps = tuple(max(1, cap(s, num_stages)) for s in range(num_stages))
    return list(build_schedules(num_stages, microbatches, caps)[stage])
