"""Benchmark suite "pipeline": smp's pipeline schedules next to torch.distributed.pipelining's.

Every strategy trains the bench LM (:meth:`LMConfig.bench`) split over ``--world-size`` stages (default 2)
with ``--microbatches`` micro-batches (default 8), on the global batch of the data-parallel suite (4 sequences
per rank). All strategies live in the same worker processes and are stepped *interleaved*, with the order
rotated each step, so background load hits them alike. They start from the same weights and see the same
batches, so their losses must agree. torch's one-stage-per-rank schedules (GPipe, 1F1B) are cut where smp's
auto-partition cuts; its multi-stage schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble in loop
placement, ZBVZeroBubble and DualPipeV in a V: :mod:`shardkit.bench.pipeline_torch`) where smp cuts its chunks
when it runs ``--virtual-stages``, ``zbv`` or ``dualpipev`` with as many chunks, else evenly by blocks; the output
says which cut each ran. The tied embedding/output weight is kept in sync by summing the two copies' gradients,
as smp does. ``--strategies`` picks them (``torch all``: every schedule the installed torch has; the others are
listed as skipped, with the reason).

The table (:mod:`shardkit.bench.pipeline_report`) gives the median and the minimum step time (slowest rank per
step; the minimum is the least disturbed by other load on a shared machine), their ratios to torch's 1F1B and
to torch's best schedule of the run, the measured bubble (time each stage spent blocked on receives,
averaged over stages) against the theory (:mod:`shardkit.bench.pipeline_theory`), the peak activation memory
per stage (bytes saved for backward, measured in one extra step per schedule), and the bytes each stage sent to
the others per step, for smp's schedules (:mod:`shardkit.bench.pipeline_smp`) and torch's
(:mod:`shardkit.bench.pipeline_torch_meters`) alike; then ``our best vs torch's best``.
``--schedules interleaved,zero_bubble`` runs several smp schedules side by side in the same processes, each with
its own weights, and prints each against the first. ``--virtual-stages v`` (interleaved 1F1B over ``v`` chunks
per stage) and ``--smp-pipeline zbv`` or ``dualpipev`` (two chunks per rank in a V) cut the model into chunks
of their own, so they run as the only smp schedule of their run.

Run it as ``shardkit bench pipeline`` (options ``--steps``, ``--warmup``, ``--world-size``/``--stages``,
``--quick``, ``--layers``, ``--microbatches``, ``--smp-pipeline simple|interleaved|zero_bubble|zbv|dualpipev``,
``--schedules``, ``--virtual-stages``, ``--strategies``, ``--smp-item-outputs``, ``--json PATH``) or
``python -m shardkit.bench.pipeline``. ``--smp-item-outputs`` makes smp's step also return ``loss.item()``, so
each step broadcasts one small object over the stages; the cost of sharing the outputs is printed below the table.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.bench.pipeline_report import Row, combine, print_report
from shardkit.bench.pipeline_settings import QUICK_LM, PipelineSettings
from shardkit.bench.pipeline_smp import SmpSchedules, action_costs
from shardkit.bench.pipeline_theory import bubble_theory
from shardkit.bench.pipeline_torch import (
    TORCH_SCHEDULES,
    TorchPipeline,
    chunk_ranks,
    strategy_names,
    torch_cuts,
    torch_schedule_class,
)
from shardkit.demo.task import MarkovTask
from shardkit.distributed import collectives
from shardkit.launch import launch_local
from shardkit.modelparallel.config import PIPELINES
from shardkit.models import TransformerLM
from shardkit.strategies.live import quiet_torch_deprecations
from shardkit.utils.report import write_json

#: Re-exported: they lived here before the theory and the report got files of their own.
__all__ = ["PipelineSettings", "Row", "bubble_theory", "combine", "run", "strategy_names", "torch_cuts"]


def _build_lm(settings: PipelineSettings) -> TransformerLM:
    torch.manual_seed(settings.seed)
    return TransformerLM(settings.lm)


def _strategies(
    settings: PipelineSettings, names: list[str], task: MarkovTask
) -> tuple[dict[str, Any], Optional[SmpSchedules], dict[str, str]]:
    """Build every strategy of this rank (smp first: it partitions, and torch's stages may take its cut)."""
    n = settings.stages
    tied_group = dist.new_group(sorted({0, n - 1}))
    lives: dict[str, Any] = {}
    smp_live: Optional[SmpSchedules] = None
    if "smp" in names:
        smp_live = SmpSchedules(settings, settings.schedules, lambda: _build_lm(settings))
        tokens, _ = task.batch(settings.global_batch, settings.lm.seq_len, torch.Generator().manual_seed(0))
        smp_live.partition(tokens)
        for schedule in settings.schedules:
            lives[settings.smp_name(schedule)] = _SmpRun(smp_live, schedule)
    layouts = {TORCH_SCHEDULES[name].layout for name in names if name in TORCH_SCHEDULES}
    cuts = torch_cuts(settings, layouts, smp_live.model.placement if smp_live else None)
    for name in names:
        if name in TORCH_SCHEDULES:
            layout = TORCH_SCHEDULES[name].layout
            cut = cuts[layout][0]
            ranks = chunk_ranks(layout, n, len(cut) // n)
            group = dist.new_group(list(range(n)))
            cls = torch_schedule_class(name)
            lives[name] = TorchPipeline(cls, settings, lambda: _build_lm(settings), group, tied_group, cut, ranks)
    return lives, smp_live, {layout: line for layout, (_, line) in cuts.items()}


def _worker(settings: PipelineSettings, names: list[str]) -> dict[str, Any]:
    """One rank: build every strategy, train them interleaved, return step times, losses and smp's waits."""
    quiet_torch_deprecations()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    bench_group = dist.new_group(list(range(settings.stages)))
    task = MarkovTask.create(settings.lm.vocab_size, seed=settings.seed)
    lives, smp_live, cut_lines = _strategies(settings, names, task)
    if "smp" in names:
        at = names.index("smp")
        names = names[:at] + [settings.smp_name(s) for s in settings.schedules] + names[at + 1 :]
    times: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    for step in range(settings.warmup + settings.steps):
        gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
        tokens, targets = task.batch(settings.global_batch, settings.lm.seq_len, gen)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            if isinstance(lives[name], _SmpRun):
                lives[name].prepare()
            collectives.barrier(bench_group, "bench.step_start")
            start = time.perf_counter()
            loss = lives[name].step(tokens, targets)
            elapsed = time.perf_counter() - start
            if step >= settings.warmup:
                times[name].append(elapsed)
            losses[name].append(loss)
    result: dict[str, Any] = {"rank": dist.get_rank(), "times": times, "losses": losses, "cuts": cut_lines}
    if smp_live is not None:
        _smp_results(settings, smp_live, result, tokens, targets)
    _torch_results(settings, lives, result, tokens, targets)
    dist.destroy_process_group()
    return result


def _torch_results(
    settings: PipelineSettings, lives: dict[str, Any], result: dict[str, Any], tokens: Any, targets: Any
) -> None:
    """torch's measurements of every schedule into ``result``: bytes sent and receive waits of the timed steps,
    peak activation memory (one more step each, every rank in the same order)."""
    for name, live in lives.items():
        if isinstance(live, TorchPipeline):
            result.setdefault("torch_sent", {})[name] = live.meters.sent[settings.warmup :]
            result.setdefault("torch_wait", {})[name] = live.meters.waits[settings.warmup :]
            result.setdefault("torch_peak_activation", {})[name] = live.peak_activation_bytes(tokens, targets)


def _smp_results(
    settings: PipelineSettings, smp_live: SmpSchedules, result: dict[str, Any], tokens: Any, targets: Any
) -> None:
    """smp's measurements of every schedule into ``result``: peak activation memory (one more step each),
    receive waits, output sharing, F/B/W costs and the last step's trace."""
    for schedule in settings.schedules:
        name = settings.smp_name(schedule)
        saved, with_w = smp_live.peak_activation_bytes(schedule, tokens, targets)
        result.setdefault("smp_peak_activation", {})[name] = saved
        result.setdefault("smp_peak_with_w_grads", {})[name] = with_w
        result.setdefault("smp_wait", {})[name] = smp_live.waits[schedule][settings.warmup :]
        result.setdefault("smp_share", {})[name] = smp_live.shares[schedule][settings.warmup :]
        result.setdefault("smp_sent", {})[name] = smp_live.sent[schedule][settings.warmup :]
        costs = action_costs(smp_live.costs[schedule][settings.warmup :], settings.microbatches)
        result.setdefault("smp_costs", {})[name] = costs
        result.setdefault("smp_trace", {})[name] = smp_live.traces.get(schedule, [])
    result["placement"] = str(smp_live.model.placement)
    smp_live.smp.reset()


class _SmpRun:
    """One smp schedule as a strategy of the suite."""

    def __init__(self, schedules: SmpSchedules, schedule: str) -> None:
        self.schedules, self.schedule = schedules, schedule

    def prepare(self) -> None:
        """Swap this schedule's weights in (before the timed region)."""
        self.schedules.use(self.schedule)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step under this schedule."""
        return self.schedules.step(self.schedule, tokens, targets)


def run(argv: list[str]) -> None:
    """Entry point of ``shardkit bench pipeline``."""
    parser = argparse.ArgumentParser(prog="shardkit bench pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="pipeline stages = processes (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (default 2)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stages", type=int, default=None, help="the same as --world-size")
    parser.add_argument("--smp-pipeline", choices=PIPELINES, default="interleaved")
    parser.add_argument(
        "--schedules",
        default=None,
        help="smp schedules to compare side by side, comma-separated (e.g. interleaved,zero_bubble; "
        "default: --smp-pipeline)",
    )
    parser.add_argument(
        "--virtual-stages", type=int, default=1, help="smp model chunks per stage (interleaved schedule only)"
    )
    parser.add_argument("--smp-optimize", choices=("speed", "memory"), default="speed")
    parser.add_argument("--smp-item-outputs", action="store_true", help="smp's step also returns loss.item()")
    parser.add_argument(
        "--strategies",
        default="smp,torch all",
        help="comma-separated: smp, 'torch all' (every schedule this torch has) or any of "
        + ", ".join(TORCH_SCHEDULES),
    )
    parser.add_argument("--layers", type=int, default=None, help="blocks of the LM (default: the bench LM's 8)")
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps (seconds), for tests")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    try:
        schedules = tuple(s.strip() for s in (args.schedules or "").split(",") if s.strip())
        unknown = [s for s in schedules if s not in PIPELINES]
        if unknown:
            parser.error(f"--schedules: unknown {unknown}; known: {', '.join(PIPELINES)}")
        settings = PipelineSettings(
            stages=args.stages if args.stages is not None else args.world_size,
            smp_schedules=schedules,
            microbatches=args.microbatches,
            smp_pipeline=args.smp_pipeline,
            smp_optimize=args.smp_optimize,
            smp_item_outputs=args.smp_item_outputs,
            virtual_stages=args.virtual_stages,
        )
        if settings.smp_chunked and len(settings.schedules) > 1:
            parser.error(
                "--virtual-stages and the 'zbv' and 'dualpipev' schedules cut the model into their own chunks, which "
                "the other smp schedules cannot share: give one smp schedule per run (torch's run beside it in the "
                "same processes)"
            )
        if args.quick:
            settings = replace(settings, lm=QUICK_LM, steps=2, warmup=1)
        if args.layers is not None:
            settings = replace(settings, lm=replace(settings.lm, n_layers=args.layers))
        settings = replace(
            settings,
            steps=args.steps if args.steps is not None else settings.steps,
            warmup=args.warmup if args.warmup is not None else settings.warmup,
        )
    except ValueError as exc:
        parser.error(f"{exc} (set by --world-size, --layers, --microbatches, --steps or --warmup)")
    if settings.stages < 2 or settings.lm.n_layers < settings.stages:
        parser.error(f"--world-size must be between 2 and the number of blocks ({settings.lm.n_layers})")
    if settings.global_batch % settings.microbatches:
        parser.error(
            f"the global batch {settings.global_batch} is not divisible by --microbatches {settings.microbatches}"
        )
    names, skipped = strategy_names(settings, args.strategies)
    unknown = [name for name in names if name != "smp" and name not in TORCH_SCHEDULES]
    if unknown:
        parser.error(f"--strategies: unknown {unknown}; known: smp, torch all, {', '.join(TORCH_SCHEDULES)}")
    per_rank = launch_local(_worker, settings.stages, settings, names)
    rows = combine(settings, per_rank)
    print_report(settings, rows, per_rank[0].get("placement"), per_rank[0]["cuts"], skipped)
    if args.json:
        write_json(args.json, {"settings": settings, "rows": rows})


if __name__ == "__main__":
    run(sys.argv[1:])
