"""The bubble each schedule of ``shardkit bench pipeline`` should leave, in theory (equal F, B and W times).

:func:`bubble_theory` covers smp's schedules and torch's GPipe and 1F1B; :func:`torch_bubble_theory` maps
torch.distributed.pipelining's other schedules onto the smp schedule of the same shape where one exists, and
returns ``None`` (printed as ``-``) where none does, rather than a number that would not be the schedule's.
"""

from __future__ import annotations

from typing import Optional

from shardkit.modelparallel.pipeline.pipeline_parallel import schedule_for
from shardkit.modelparallel.schedules.virtual_schedules import V_PIPELINES, bubble_fraction, schedule_grid
from shardkit.modelparallel.schedules.zb_schedules import simulate


def bubble_theory(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The bubble fraction of ``schedule`` (smp's names, or torch's ``"GPipe"``/``"1F1B"``) with equal F, B
    and W times: ZBV's and DualPipeV's from their tick grids (DualPipeV: ``(p-1)/(6m+p-1)``),
    ``(p-1)/(vm+p-1)`` for 1F1B over ``v`` virtual stages, and the others simulated from their action lists:
    ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(3m+p-1)`` for ZB-H2 when ``m >= p``, and for ZB-H1 (every
    stage holding up to ``max(2, p-1)`` micro-batches) the same at 2 stages and ``p/(3m+p)`` from 3."""
    p, m = stages, microbatches
    if schedule in V_PIPELINES:
        return bubble_fraction(schedule_grid(schedule, p, 2, m))
    if schedule == "interleaved" and virtual_stages > 1:
        return (p - 1) / (virtual_stages * m + p - 1)
    smp_name = {"GPipe": "simple", "1F1B": "interleaved"}.get(schedule, schedule)
    lists = [schedule_for(smp_name, s, p, m) for s in range(p)]
    return simulate(lists).mean_bubble()


#: torch's multi-stage schedules whose theory is an smp schedule's: (smp schedule, uses the chunks per rank).
#: Looped BFS runs every micro-batch through a rank's first chunk before its second: one fill and one drain
#: over ``v * m`` micro-batch-chunks, the interleaved formula. torch's DualPipeV runs smp's ``dualpipev`` lists,
#: action for action (an overlapped pair is its forward then its whole backward, as smp runs it). Interleaved
#: zero bubble has no equal-cost model here (its order depends on torch's own heuristics), so it prints ``-``.
_TORCH_AS_SMP = {
    "GPipe": ("GPipe", False),
    "1F1B": ("1F1B", False),
    "Interleaved1F1B": ("interleaved", True),
    "LoopedBFS": ("interleaved", True),
    "ZBVZeroBubble": ("zbv", False),
    "DualPipeV": ("dualpipev", False),
}


def torch_bubble_theory(schedule: str, stages: int, microbatches: int, chunks_per_rank: int) -> Optional[float]:
    """The theoretical bubble of torch's ``schedule`` (its class name without ``Schedule``), or ``None`` when
    the bench has no model of it."""
    if schedule not in _TORCH_AS_SMP:
        return None
    smp_name, chunked = _TORCH_AS_SMP[schedule]
    return bubble_theory(smp_name, stages, microbatches, chunks_per_rank if chunked else 1)
