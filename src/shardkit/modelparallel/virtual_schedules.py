"""Schedules over virtual stages: ``v`` model chunks per pipeline rank, and the ticks every rank runs them in.

With ``"virtual_stages": v`` the model is cut into ``p * v`` chunks for ``p`` pipeline ranks, in loop
placement: rank ``r`` holds chunks ``r, r + p, r + 2p, ...``, so a micro-batch's forward visits every rank
``v`` times. Each rank runs the interleaved 1F1B schedule of Narayanan et al. 2021 ("Efficient large-scale
language model training on GPU clusters"): micro-batches go through a rank's chunks in rounds of ``p``
(``p`` micro-batches through its first chunk, the same ``p`` through its second, ...), which keeps every rank
busy while the first micro-batches travel, and divides 1F1B's bubble by ``v``:

- warm-up: ``(v - 1) * p + 2 * (p - 1 - r)`` forwards (all of them when there are fewer), enough for the first
  backward of the last chunk to be possible when the warm-up ends;
- steady state: one forward, one backward;
- cool-down: the remaining backwards, chunks in reverse order.

Backwards visit a rank's chunks in the reverse order of forwards (the last chunk first). The order needs
``microbatches`` to be a multiple of ``p`` (each round is ``p`` micro-batches); :func:`check_virtual_config`
says so before anything runs.

Ticks. :func:`tick_grid` lays the ranks' action lists side by side on a common clock: at tick ``t`` each
rank runs at most one action, and an action runs at the first tick after every action it needs (the previous
chunk's forward of the same micro-batch, the next chunk's backward) ran. Every rank computes the same grid,
so it knows which actions its neighbours run at every tick, hence which messages they produce then.
"""

from __future__ import annotations

from typing import NamedTuple, Optional


class ChunkAction(NamedTuple):
    """One unit of a rank's virtual-stage schedule: ``kind`` ``"F"`` or ``"B"`` of ``chunk`` on ``microbatch``."""

    kind: str
    chunk: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.chunk}"


def check_virtual_config(partitions: int, virtual_stages: int, microbatches: int, pipeline: str) -> None:
    """Raise ``ValueError`` when the interleaved schedule over ``virtual_stages`` chunks per rank cannot run."""
    if virtual_stages == 1:
        return
    if partitions < 2:
        raise ValueError(
            f"smp config virtual_stages={virtual_stages} needs partitions >= 2 (the chunks of a model are spread "
            "over the pipeline ranks); with one partition set virtual_stages to 1"
        )
    if pipeline != "interleaved":
        raise ValueError(
            f"smp config virtual_stages={virtual_stages} runs the interleaved 1F1B schedule over the chunks, but "
            f"pipeline={pipeline!r}: set pipeline to 'interleaved' or virtual_stages to 1"
        )
    if microbatches % partitions:
        raise ValueError(
            f"smp config virtual_stages={virtual_stages}: the interleaved schedule sends micro-batches through a "
            f"rank's chunks in rounds of partitions={partitions}, so microbatches ({microbatches}) must be a "
            f"multiple of {partitions}; use e.g. microbatches={partitions * max(1, microbatches // partitions + 1)}"
        )


def interleaved_schedule(rank: int, num_ranks: int, virtual_stages: int, microbatches: int) -> list[ChunkAction]:
    """Interleaved 1F1B for ``rank``: its chunks ``rank + j * num_ranks``, warm-up / steady state / cool-down.

    Example (2 ranks, 2 chunks each, 2 micro-batches; rank 0 holds chunks 0 and 2)::

        >>> interleaved_schedule(0, 2, 2, 2)
        [F0@0, F1@0, F0@2, F1@2, B0@2, B1@2, B0@0, B1@0]
    """
    p, v, m = num_ranks, virtual_stages, microbatches
    total = m * v  # forwards (and backwards) on this rank

    def forward_of(i: int) -> ChunkAction:
        # The i-th forward: rounds of p micro-batches through each local chunk in turn.
        local = (i // p) % v
        mb = (i // (p * v)) * p + i % p
        return ChunkAction("F", local * p + rank, mb)

    def backward_of(i: int) -> ChunkAction:
        local = v - 1 - (i // p) % v
        mb = (i // (p * v)) * p + i % p
        return ChunkAction("B", local * p + rank, mb)

    warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)
    actions = [forward_of(i) for i in range(warmup)]
    for i in range(total - warmup):  # steady state
        actions += [forward_of(warmup + i), backward_of(i)]
    actions += [backward_of(i) for i in range(total - warmup, total)]  # cool-down
    return actions


def tick_grid(schedules: list[list[ChunkAction]], num_ranks: int, num_chunks: int) -> list[list[Optional[ChunkAction]]]:
    """Align every rank's actions on common ticks: ``grid[t][r]`` is rank ``r``'s action at tick ``t`` (None: idle).

    An action runs at the earliest tick after its rank's previous action and after the actions whose messages
    it consumes (``F k`` of the previous chunk; ``B k`` of the next chunk). Raises if the schedules wait on
    each other in a cycle (a schedule bug: no rank could make progress).
    """
    done: dict[tuple[str, int, int], int] = {}  # action -> tick it ran at
    position = [0] * num_ranks
    grid: list[list[Optional[ChunkAction]]] = []
    remaining = sum(len(s) for s in schedules)
    while remaining:
        tick = len(grid)
        row: list[Optional[ChunkAction]] = [None] * num_ranks
        for rank, actions in enumerate(schedules):
            if position[rank] == len(actions):
                continue
            action = actions[position[rank]]
            if action.kind == "F":
                need = ("F", action.chunk - 1, action.microbatch) if action.chunk > 0 else None
            else:
                last = action.chunk == num_chunks - 1
                need = None if last else ("B", action.chunk + 1, action.microbatch)
            if need is None or done.get(need, tick) < tick:
                row[rank] = action
        if all(a is None for a in row):
            stuck = [s[position[r]] for r, s in enumerate(schedules) if position[r] < len(s)]
            raise RuntimeError(f"virtual-stage schedules wait on each other in a cycle at {stuck}")
        for rank, ran in enumerate(row):
            if ran is not None:
                done[(ran.kind, ran.chunk, ran.microbatch)] = tick
                position[rank] += 1
                remaining -= 1
        grid.append(row)
    return grid


def interleaved_grid(num_ranks: int, virtual_stages: int, microbatches: int) -> list[list[Optional[ChunkAction]]]:
    """The tick grid of the interleaved 1F1B schedule for every rank (see :func:`tick_grid`)."""
    schedules = [interleaved_schedule(r, num_ranks, virtual_stages, microbatches) for r in range(num_ranks)]
    return tick_grid(schedules, num_ranks, num_ranks * virtual_stages)


def bubble_fraction(grid: list[list[Optional[ChunkAction]]]) -> float:
    """Idle ticks over all ticks, with forwards and backwards counted as one tick each (the schedule's bubble)."""
    slots = len(grid) * len(grid[0]) if grid else 0
    idle = sum(a is None for row in grid for a in row)
    return idle / slots if slots else 0.0
