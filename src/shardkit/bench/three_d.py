"""Benchmark suite "3d": smp's 3-D layout (pipeline x tensor x data) against pipeline x data alone, and the planner.

One run of ``--world-size`` gloo processes (8 by default) trains :func:`shardkit.models.smp_lm.smp_lm` (smp's
``DistributedTransformerLayer`` blocks) through smp's API in each layout, on the same global batch: pipeline 2 x
tensor 2 x data ``W/4`` (each rank feeding its own batch, and with ``prescaled_batch``, the tensor pair sharing one as
AWS's GPT scripts set it) against pipeline 2 x data ``W/2`` and pipeline 4 x data ``W/4`` (``--quick``: the first
and the third only). Reported per layout: the median step time of the slowest rank and its ratio to pipeline 2 x
data, and the memory per rank (the rank with the highest peak) and bytes sent per step against ``shardkit plan``'s
figures for the same layout (:mod:`shardkit.plan.layouts`, planned on the meta device for the gloo backend); see
:mod:`shardkit.bench.three_d_measure` for how each is measured.

Run it as ``shardkit bench 3d`` (options ``--world-size``, ``--steps``, ``--warmup``, ``--quick``, ``--json PATH``)
or ``python -m shardkit.bench.three_d``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from shardkit.bench.three_d_measure import LayoutRun, ThreeDSettings, quick, worker
from shardkit.launch import launch_local
from shardkit.memory.meter import format_bytes
from shardkit.plan import Estimate, estimate
from shardkit.plan.layouts import Layout
from shardkit.utils.report import format_table, ratio, write_json


@dataclass(frozen=True)
class Compared:
    """One layout over every rank: step time, and the measured rank with the highest peak beside the plan."""

    label: str
    median_s: float
    measured_peak: int
    planned_peak: int
    measured_state: int
    planned_state: int
    measured_sent: int
    planned_sent: int


def layouts_for(world_size: int, is_quick: bool) -> list[Layout]:
    """The 3-D layouts and the pipeline x data layouts they are compared with at ``world_size`` (a multiple of 4)."""
    if world_size % 4:
        raise SystemExit(f"--world-size must be a multiple of 4 (pipeline 2 x tensor 2 x data), got {world_size}")
    out = [Layout(2, 2, world_size // 4), Layout(2, 1, world_size // 2)]
    return (
        out
        if is_quick
        else [out[0], Layout(2, 2, world_size // 4, prescaled=True), *out[1:], Layout(4, 1, world_size // 4)]
    )


def plan(s: ThreeDSettings, layout: Layout) -> Estimate:
    """The planner's estimate of ``layout`` (the stage with the highest peak), for the gloo backend."""
    work = s.workload(layout)
    return estimate(
        work.build, work.batch(), loss_fn=work.loss, strategy="smp", world_size=layout.world_size,
        strategy_options=work.strategy_options, backend="gloo",
    )  # fmt: skip


def combine(per_rank: list[list[LayoutRun]], planned: list[Estimate]) -> list[Compared]:
    """Per layout: the median over steps of the slowest rank's time, and the highest-peak rank's measurements."""
    out = []
    for i, est in enumerate(planned):
        runs = [ranks[i] for ranks in per_rank]
        slowest = [max(times) for times in zip(*(run.step_s for run in runs))]
        worst = max(runs, key=lambda run: run.real.peak_bytes).real
        out.append(
            Compared(
                runs[0].label, statistics.median(slowest), worst.peak_bytes, est.peak_bytes, worst.state_bytes,
                est.state_bytes, sum(worst.comm_wire_bytes.values()), sum(est.comm_bytes.values()),
            )
        )  # fmt: skip
    return out


def report(results: list[Compared], s: ThreeDSettings, world_size: int) -> str:
    """The suite's table and notes."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    header = (
        f"3d suite: smp_lm {s.layers} DistributedTransformerLayer blocks x width {s.dim}, {s.heads} heads, vocab "
        f"{s.vocab}, seq {s.seq}, {s.batch} sequences per rank (global batch {s.batch * world_size}); AdamW; smp "
        f"1F1B, 2 x pipeline micro-batches per replica; {s.rounds} rounds of {s.warmup} warm-up + {s.steps} timed "
        f"steps per layout, alternating; gloo, CPU, 1 thread per rank, world {world_size}; load average {load:.2f} "
        "at the end"
    )
    base = next(r for r in results if r.label == f"pp2 x tp1 x dp{world_size // 2}")
    rows = [
        [
            r.label, f"{r.median_s * 1e3:.1f}", ratio(r.median_s, base.median_s),
            format_bytes(r.measured_peak), format_bytes(r.planned_peak), ratio(r.planned_peak, r.measured_peak),
            format_bytes(r.measured_state), format_bytes(r.planned_state), format_bytes(r.measured_sent),
            format_bytes(r.planned_sent),
        ]
        for r in results
    ]  # fmt: skip
    headers = ["layout", "ms/step", f"vs {base.label}", "peak/rank measured", "planned", "planned/measured"]
    headers += ["state/rank measured", "planned", "sent/step measured", "planned"]
    notes = (
        "ms/step: median over the timed steps of the slowest rank. peak: the rank with the highest peak "
        "(shardkit's MemoryTracker: tensor bytes alive), against the planner's stage with the highest peak "
        "(shardkit plan --smp-layouts, meta device). state: parameters, gradients and optimizer state after a step. "
        "sent: that rank's bytes in one step (comm meter, ring model) against the planned rank's."
    )
    return "\n".join([header, "", format_table(headers, rows), "", notes])


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of the suite (also accepted through ``shardkit bench 3d ...``)."""
    parser = argparse.ArgumentParser(prog="shardkit bench 3d", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8, help="worker processes, a multiple of 4 (default 8)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per layout and round (default 4)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first in each round (default 1)")
    parser.add_argument("--quick", action="store_true", help="tiny model, two layouts, one step (seconds), for tests")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args, _unknown = parser.parse_known_args(argv)
    return args


def settings_from_args(args: argparse.Namespace) -> ThreeDSettings:
    """Suite settings for parsed options (raises SystemExit on bad values)."""
    s = quick(ThreeDSettings()) if args.quick else ThreeDSettings()
    steps = s.steps if args.steps is None else args.steps
    if steps < 1:
        raise SystemExit(f"--steps must be at least 1, got {steps}")
    return replace(s, steps=steps, warmup=s.warmup if args.warmup is None else max(0, args.warmup))


def run(argv: list[str]) -> None:
    """Run the suite with command-line options ``argv`` and print its table."""
    args = parse_args(argv)
    s = settings_from_args(args)
    layouts = layouts_for(args.world_size, args.quick)
    start = time.perf_counter()
    planned = [plan(s, layout) for layout in layouts]
    results = combine(launch_local(worker, args.world_size, s, layouts), planned)
    print(report(results, s, args.world_size), flush=True)
    print(f"\n(suite wall time {time.perf_counter() - start:.0f} s)", flush=True)
    if args.json:
        payload: dict[str, Any] = {"settings": s, "world_size": args.world_size, "results": results}
        write_json(args.json, payload)


if __name__ == "__main__":
    run(sys.argv[1:])
