"""The table ``shardkit plan --smp-layouts`` prints: each layout's per-rank memory by category and its traffic.

One line per planned layout (:mod:`shardkit.plan.layouts`), by world size, those that fit first, fastest predicted
step first. Memory is the planned peak of the stage with the highest one and, at that peak, its parameters,
gradients, optimizer state and activations (the micro-batches the schedule keeps in flight), and ``other``: the rest
of the peak (communication buffers, among them smp's gradient buckets and pipeline receive buffers, and
temporaries, among them gradients still being accumulated when the peak falls inside the pipeline's
forward/backward: the planner names them gradients once backward is over). Traffic is what one
rank sends per step by collective kind, which in smp's layouts names its group: ``TP`` the all-gathers and
reduce-scatters around each tensor-parallel block (the tensor-parallel group's batches in and out, without
``prescaled_batch``; with it the blocks' sums are all-reduces, counted under ``all-reduce``; sharded data
parallelism's gathers and gradient reduce-scatters count under ``TP`` too), ``p2p`` the
pipeline's activations and gradients between stages, ``all-reduce`` the gradient reduction over smp's
data-parallel group (``data x tensor`` ranks: the unsplit parameters' gradients also sum over the tensor group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from shardkit.memory.meter import format_bytes
from shardkit.utils.report import format_table

if TYPE_CHECKING:
    from shardkit.plan.api import Estimate
    from shardkit.plan.settings import Setting

#: The table's traffic columns: heading, the collective kinds summed into it.
TRAFFIC = (("TP", ("all_gather", "reduce_scatter")), ("p2p", ("send",)), ("all-reduce", ("all_reduce",)))
#: The memory columns: heading, the planner's category at the peak.
MEMORY = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer_state"),
          ("activations", "activations"))  # fmt: skip


def traffic(est: Estimate) -> dict[str, int]:
    """Bytes one rank sends per step under each of :data:`TRAFFIC`'s headings."""
    return {name: sum(est.comm_bytes.get(kind, 0) for kind in kinds) for name, kinds in TRAFFIC}


def layout_table(results: Sequence[tuple[Setting, Estimate]], memory: int, host_memory: Optional[int] = None) -> str:
    """The layouts as a Markdown table (see the module docstring)."""
    headings = ["world", "layout", "micro-batches", "peak/rank", *(h for h, _ in MEMORY), "other"]
    headings += [f"{h} sent" for h, _ in TRAFFIC] + ["step ms", "fits"]
    rows = []

    def order(result: tuple[Setting, Estimate]) -> tuple[int, bool, float]:
        est = result[1]
        return est.world_size, not est.fits(memory, host_memory), est.step_seconds

    for setting, est in sorted(results, key=order):
        sent = traffic(est)
        rows.append(
            [
                str(est.world_size),
                setting.label,
                str(setting.options.get("microbatches", 1)),
                format_bytes(est.peak_bytes),
                *(format_bytes(est.peak_breakdown.get(category, 0)) for _, category in MEMORY),
                format_bytes(est.peak_bytes - sum(est.peak_breakdown.get(category, 0) for _, category in MEMORY)),
                *(format_bytes(sent[name]) for name, _ in TRAFFIC),
                f"{est.step_seconds * 1e3:.2f}",
                "yes" if est.fits(memory, host_memory) else "no",
            ]
        )
    return format_table(headings, rows)


__all__ = ["MEMORY", "TRAFFIC", "layout_table", "traffic"]
