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

ZBV (:mod:`~shardkit.modelparallel.schedules.zbv`): two chunks per rank in a V (rank ``r`` holds chunks ``r`` and
``2p - 1 - r``), every backward split into B and W (run whole where nothing waits for the split:
:func:`fused_backwards`); needs ``microbatches >= 2p``. DualPipeV (:mod:`~shardkit.modelparallel.schedules.dualpipev`)
runs the same V in another order, under the same checks.
"""

from __future__ import annotations

from typing import Optional

from shardkit.modelparallel.schedules.chunk_action import ChunkAction
from shardkit.modelparallel.schedules.dualpipev import dualpipev_schedules
from shardkit.modelparallel.schedules.zbv import zbv_schedules

V_PIPELINES = ("zbv", "dualpipev")
"""The schedules with two chunks per rank in a V, every backward split into B and W (see :func:`fused_backwards`)."""


def check_virtual_config(partitions: int, virtual_stages: int, microbatches: int, pipeline: str) -> None:
    """Raise ``ValueError`` when the schedule over several chunks per rank cannot run."""
    if pipeline in V_PIPELINES:
        _check_v(pipeline, partitions, virtual_stages, microbatches)
        return
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


def _check_v(pipeline: str, partitions: int, virtual_stages: int, microbatches: int) -> None:
    if virtual_stages not in (1, 2):
        raise ValueError(
            f"smp config pipeline={pipeline!r} places exactly two chunks per rank, in a V; "
            f"virtual_stages={virtual_stages} asks for another number: leave virtual_stages out (or set it to 2)"
        )
    if partitions < 2:
        raise ValueError(
            f"smp config pipeline={pipeline!r} needs partitions >= 2; with one partition use 'interleaved'"
        )
    if microbatches < 2 * partitions:
        raise ValueError(
            f"smp config pipeline={pipeline!r} needs at least 2 x partitions = {2 * partitions} micro-batches to "
            f"fill its V (got microbatches={microbatches}): raise microbatches, or use pipeline='interleaved'"
        )


def placement(pipeline: str, num_ranks: int, virtual_stages: int) -> tuple[int, ...]:
    """The rank of every chunk: loop placement (chunk ``c`` on rank ``c % p``), or a V for ``"zbv"`` and
    ``"dualpipev"`` (rank ``r`` holds chunks ``r`` and ``2p - 1 - r``, so the first and the last chunk, where the
    loss is, share rank 0)."""
    if pipeline in V_PIPELINES:
        return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))
    return tuple(c % num_ranks for c in range(num_ranks * virtual_stages))


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
            need: Optional[tuple[str, int, int]]
            if action.kind == "F":
                need = ("F", action.chunk - 1, action.microbatch) if action.chunk > 0 else None
            elif action.kind == "W":
                need = None  # after its own B, earlier on the same rank
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


def fused_backwards(grid: list[list[Optional[ChunkAction]]], rank: int) -> set[tuple[int, int]]:
    """The (chunk, micro-batch) pairs whose split backward ``rank`` may run whole, at B's tick.

    A split pays for itself only where W fills a tick that B's input gradients are already travelling in. Where
    ``rank`` runs W right after B (ticks ``t`` and ``t + 1``) and no rank needs those gradients before tick
    ``t + 2`` (the previous chunk's B, of the same micro-batch, runs then or later; chunk 0 has none), running
    both at tick ``t`` delays nothing on the grid. It saves the split's cost: the graph walk, one autograd call
    per weight group instead of one in all, and the saved-tensor hooks on that micro-batch's forward. DualPipeV's
    paired steps and much of ZBV are such; the other ranks' grids are unchanged (a rank's messages stay at
    their ticks).
    """
    at = {(a.kind, a.chunk, a.microbatch): t for t, row in enumerate(grid) for a in row if a is not None}
    fused = set()
    for t, row in enumerate(grid[:-1]):
        action, after = row[rank], grid[t + 1][rank]
        if action is None or action.kind != "B" or after != ChunkAction("W", action.chunk, action.microbatch):
            continue
        consumer = at.get(("B", action.chunk - 1, action.microbatch))
        if consumer is None or consumer >= t + 2:
            fused.add((action.chunk, action.microbatch))
    return fused


def interleaved_grid(num_ranks: int, virtual_stages: int, microbatches: int) -> list[list[Optional[ChunkAction]]]:
    """The tick grid of the interleaved 1F1B schedule for every rank (see :func:`tick_grid`)."""
    schedules = [interleaved_schedule(r, num_ranks, virtual_stages, microbatches) for r in range(num_ranks)]
    return tick_grid(schedules, num_ranks, num_ranks * virtual_stages)


def schedule_grid(
    pipeline: str, num_ranks: int, virtual_stages: int, microbatches: int
) -> list[list[Optional[ChunkAction]]]:
    """The tick grid of ``pipeline`` over chunks: interleaved 1F1B (loop placement), ZBV or DualPipeV."""
    if pipeline == "zbv":
        return tick_grid(zbv_schedules(num_ranks, microbatches), num_ranks, 2 * num_ranks)
    if pipeline == "dualpipev":
        return tick_grid(dualpipev_schedules(num_ranks, microbatches), num_ranks, 2 * num_ranks)
    return interleaved_grid(num_ranks, virtual_stages, microbatches)


def bubble_fraction(grid: list[list[Optional[ChunkAction]]]) -> float:
    """Idle ticks over all ticks, with forwards and backwards counted as one tick each (the schedule's bubble)."""
    slots = len(grid) * len(grid[0]) if grid else 0
    idle = sum(a is None for row in grid for a in row)
    return idle / slots if slots else 0.0
