"""Benchmark suite "pipeline": the smp pipeline next to torch.distributed.pipelining's GPipe and 1F1B.

Every strategy trains the bench LM (:meth:`LMConfig.bench`) split over ``--world-size`` stages (default 2)
with ``--microbatches`` micro-batches (default 8), on the global batch of the data-parallel suite (4 sequences
per rank). All strategies live in the same worker processes and are stepped *interleaved*, with the order
rotated each step, so background load hits them alike. They start from the same weights and see the same
batches, so their losses must agree. torch.pipelining's stages are cut where smp's auto-partition cuts for two
stages (embedding and the first half of the blocks | the rest); its tied embedding/output weight is kept in
sync by an all-reduce of the two copies' gradients, as smp does.

The table gives the median and the minimum step time (slowest rank per step; the minimum is the least
disturbed by other load on a shared machine), their ratios to torch's 1F1B, and smp's measured
bubble (time each stage spent blocked on receives, averaged over stages) against the theory
(:func:`bubble_theory`), and smp's peak activation memory per stage (bytes saved for backward, measured in one
extra step per schedule: :mod:`shardkit.bench.pipeline_smp`). ``--schedules interleaved,zero_bubble`` runs
several smp schedules side by side in the same processes, each with its own weights, and prints each against
the first. ``--virtual-stages v`` (interleaved 1F1B over ``v`` chunks per stage) and ``--smp-pipeline zbv`` cut
the model into chunks of their own, so they run as the only smp schedule of their run (torch's beside them, cut
evenly by blocks).

Run it as ``shardkit bench pipeline`` (options ``--steps``, ``--warmup``, ``--world-size``/``--stages``,
``--quick``, ``--microbatches``, ``--smp-pipeline simple|interleaved|zero_bubble|zbv``, ``--schedules``,
``--virtual-stages``,
``--smp-item-outputs``, ``--json PATH``) or
``python -m shardkit.bench.pipeline``. ``--smp-item-outputs`` makes smp's step also return ``loss.item()``, so each
step broadcasts one small object over the stages; the cost of sharing the outputs is printed below the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.bench.pipeline_smp import SmpSchedules, action_costs, predicted_bubble
from shardkit.bench.pipeline_torch import TorchPipeline, block_split
from shardkit.demo.task import MarkovTask
from shardkit.distributed import collectives
from shardkit.launch import launch_local
from shardkit.modelparallel.config import PIPELINES
from shardkit.modelparallel.pipeline_parallel import schedule_for
from shardkit.modelparallel.virtual_schedules import bubble_fraction, schedule_grid
from shardkit.modelparallel.zb_schedules import simulate
from shardkit.models import LMConfig, TransformerLM
from shardkit.strategies.live import quiet_torch_deprecations
from shardkit.utils.checks import at_least, positive
from shardkit.utils.report import format_table, ratio, write_json

QUICK_LM = LMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)


@dataclass(frozen=True)
class PipelineSettings:
    """What the suite runs; plain data handed to every worker."""

    lm: LMConfig = field(default_factory=LMConfig.bench)
    stages: int = 2
    #: As the data-parallel suite: the global batch is batch_per_rank * stages.
    batch_per_rank: int = 4
    microbatches: int = 8
    steps: int = 8
    warmup: int = 2
    lr: float = 1e-3
    seed: int = 0
    smp_pipeline: str = "interleaved"
    #: smp schedules to run side by side (``--schedules``); empty means just ``smp_pipeline``.
    smp_schedules: tuple[str, ...] = ()
    #: Auto-partition balancing compute (memory_weight 0.2)
    smp_optimize: str = "speed"
    #: smp's step also returns ``loss.item()``: every step then broadcasts one small object over the stages.
    smp_item_outputs: bool = False
    #: smp's ``virtual_stages`` (``--virtual-stages``): model chunks per stage under the interleaved schedule.
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("stages", "batch_per_rank", "microbatches", "steps"):
            at_least(self, name, getattr(self, name), 1)
        at_least(self, "warmup", self.warmup, 0)
        at_least(self, "virtual_stages", self.virtual_stages, 1)
        positive(self, "lr", self.lr)

    @property
    def schedules(self) -> list[str]:
        """The smp schedules this run compares (the first is the baseline of the smp ratios)."""
        return list(self.smp_schedules) or [self.smp_pipeline]

    def smp_name(self, schedule: str) -> str:
        """The row name of smp under ``schedule``: plain ``smp`` when only one schedule runs."""
        return "smp" if len(self.schedules) == 1 else f"smp {schedule}"

    @property
    def smp_chunked(self) -> bool:
        """smp cuts the model into more chunks than stages (virtual stages, ZBV): its cut is not torch's."""
        return self.virtual_stages > 1 or "zbv" in self.schedules

    @property
    def global_batch(self) -> int:
        """Sequences per step, over all micro-batches."""
        return self.batch_per_rank * self.stages


def _build_lm(settings: PipelineSettings) -> TransformerLM:
    torch.manual_seed(settings.seed)
    return TransformerLM(settings.lm)


def _worker(settings: PipelineSettings, names: list[str]) -> dict[str, Any]:
    """One rank: build every strategy, train them interleaved, return step times, losses and smp's waits."""
    quiet_torch_deprecations()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    rank, n = dist.get_rank(), settings.stages
    bench_group = dist.new_group(list(range(n)))
    tied_group = dist.new_group(sorted({0, n - 1}))
    task = MarkovTask.create(settings.lm.vocab_size, seed=settings.seed)
    lives: dict[str, Any] = {}
    placement = None
    smp_live: Optional[SmpSchedules] = None
    if "smp" in names:  # smp partitions on its first step; torch's stages then get the same cut
        smp_live = SmpSchedules(settings, settings.schedules, lambda: _build_lm(settings))
        tokens, _ = task.batch(settings.global_batch, settings.lm.seq_len, torch.Generator().manual_seed(0))
        smp_live.partition(tokens)
        placement = None if settings.smp_chunked else smp_live.model.placement  # else torch cuts evenly
        at = names.index("smp")
        names = names[:at] + [settings.smp_name(s) for s in settings.schedules] + names[at + 1 :]
        for schedule in settings.schedules:
            lives[settings.smp_name(schedule)] = _SmpRun(smp_live, schedule)
    torch_schedules = {"torch GPipe": ScheduleGPipe, "torch 1F1B": Schedule1F1B}
    for name in names:
        if name in torch_schedules:
            group = dist.new_group(list(range(n)))
            lives[name] = TorchPipeline(
                torch_schedules[name], settings, lambda: _build_lm(settings), group, tied_group, placement
            )
        elif name not in lives:
            raise ValueError(f"unknown strategy {name!r}; known: smp, {', '.join(torch_schedules)}")
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
    result: dict[str, Any] = {"rank": rank, "times": times, "losses": losses}
    result["split"] = [list(r) for r in block_split(settings.lm.n_layers, n, placement)]
    if smp_live is not None:
        result["smp_peak_activation"] = {}
        for schedule in settings.schedules:
            name = settings.smp_name(schedule)
            saved, with_w = smp_live.peak_activation_bytes(schedule, tokens, targets)
            result["smp_peak_activation"][name] = saved
            result.setdefault("smp_peak_with_w_grads", {})[name] = with_w
            result.setdefault("smp_wait", {})[name] = smp_live.waits[schedule][settings.warmup :]
            result.setdefault("smp_share", {})[name] = smp_live.shares[schedule][settings.warmup :]
            costs = action_costs(smp_live.costs[schedule][settings.warmup :], settings.microbatches)
            result.setdefault("smp_costs", {})[name] = costs
            result.setdefault("smp_trace", {})[name] = smp_live.traces.get(schedule, [])
        result["placement"] = str(smp_live.model.placement)
        smp_live.smp.reset()
    dist.destroy_process_group()
    return result


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


@dataclass
class Row:
    """One strategy's combined result."""

    name: str
    schedule: str
    median_step_s: float
    min_step_s: float
    final_loss: float
    max_loss_diff_vs_smp: Optional[float]
    bubble_measured: Optional[float]
    bubble_per_stage: Optional[list[float]]
    #: smp: median over steps of the slowest stage's time sharing the step's outputs.
    output_share_s: Optional[float] = None
    #: smp: per stage, the peak bytes of activations saved for backward during one step (MiB).
    peak_activation_mib: Optional[list[float]] = None
    #: smp: per stage, the peak of those and the gradients a split backward keeps for W, together (MiB).
    peak_with_w_grads_mib: Optional[list[float]] = None
    #: smp: per stage, the median milliseconds of one F, B and W (unsplit schedules: B includes W).
    action_ms: Optional[list[dict[str, float]]] = None
    #: smp: the bubble of this schedule's lists simulated with those per-stage times.
    bubble_predicted: Optional[float] = None
    #: smp: per stage, the last timed step's actions: (action, start s, end s, s blocked on receives).
    trace: Optional[list[list[tuple[str, float, float, float]]]] = None


def combine(settings: PipelineSettings, per_rank: list[dict[str, Any]]) -> list[Row]:
    """Per strategy: median over steps of the slowest rank's time; the last stage's losses; smp's bubble."""
    rows = []
    last = per_rank[-1]
    names = list(last["times"])
    for name in names:
        step_times = [max(r["times"][name][i] for r in per_rank) for i in range(settings.steps)]
        losses = last["losses"][name]
        diff = memory = None
        first_smp = settings.smp_name(settings.schedules[0])
        if first_smp in last["losses"] and name != first_smp:
            diff = max(abs(a - b) for a, b in zip(losses, last["losses"][first_smp]))
        bubble = per_stage = share = action_ms = predicted = with_w = None
        smp_schedules = {settings.smp_name(s): s for s in settings.schedules}
        if name in last.get("smp_wait", {}):
            costs = [r["smp_costs"][name] for r in per_rank]
            action_ms = [{k: v * 1e3 for k, v in c.items()} for c in costs]
            if not settings.smp_chunked:  # chunked schedules run on their own tick grid, with no per-action times
                predicted = predicted_bubble(smp_schedules[name], costs, settings.microbatches)
            per_stage = [statistics.fmean(r["smp_wait"][name]) for r in per_rank]
            bubble = statistics.fmean(per_stage)
            share = statistics.median(max(r["smp_share"][name][i] for r in per_rank) for i in range(settings.steps))
            memory = [r["smp_peak_activation"][name] / 2**20 for r in per_rank]
            with_w = [r["smp_peak_with_w_grads"][name] / 2**20 for r in per_rank]
        schedule = {**smp_schedules, "torch GPipe": "GPipe", "torch 1F1B": "1F1B"}[name]
        rows.append(
            Row(
                name,
                schedule,
                statistics.median(step_times),
                min(step_times),
                losses[-1],
                diff,
                bubble,
                per_stage,
                share,
                memory,
                peak_with_w_grads_mib=with_w,
                action_ms=action_ms,
                bubble_predicted=predicted,
                trace=[r["smp_trace"][name] for r in per_rank] if action_ms is not None else None,
            )
        )
    return rows


def bubble_theory(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The bubble fraction of ``schedule`` (smp's names, or torch's ``"GPipe"``/``"1F1B"``) with equal F, B
    and W times: ZBV's from its tick grid, ``(p-1)/(vm+p-1)`` for 1F1B over ``v`` virtual stages, and the others
    simulated from their action lists: ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(3m+p-1)`` for ZB-H2 when
    ``m >= p``, and for ZB-H1 (every stage holding up to ``max(2, p-1)`` micro-batches) the same at 2 stages and
    ``p/(3m+p)`` from 3."""
    p, m = stages, microbatches
    if schedule == "zbv":
        return bubble_fraction(schedule_grid("zbv", p, 2, m))
    if schedule == "interleaved" and virtual_stages > 1:
        return (p - 1) / (virtual_stages * m + p - 1)
    smp_name = {"GPipe": "simple", "1F1B": "interleaved"}.get(schedule, schedule)
    lists = [schedule_for(smp_name, s, p, m) for s in range(p)]
    return simulate(lists).mean_bubble()


def _print(settings: PipelineSettings, rows: list[Row], placement: Optional[str], split: list[list[int]]) -> None:
    p, m = settings.stages, settings.microbatches
    base = next((r for r in rows if r.name == "torch 1F1B"), None)
    print(
        f"pipeline: LM {settings.lm.n_layers} blocks x d{settings.lm.d_model}, vocab {settings.lm.vocab_size}, "
        f"seq {settings.lm.seq_len}; {p} stages x {m} micro-batches, global batch {settings.global_batch}; gloo/CPU; "
        f"median of {settings.steps} steps after {settings.warmup} warm-up; load average {os.getloadavg()[0]:.1f}"
    )
    headers = ["strategy", "schedule", "median ms", "vs torch 1F1B", "min ms", "vs torch 1F1B (min)"]
    headers += ["bubble measured", "bubble theory", "peak act. MiB/stage", "loss", "loss diff"]
    table = []
    for r in rows:
        v = settings.virtual_stages if r.name.startswith("smp") else 1
        measured = "-" if r.bubble_measured is None else f"{r.bubble_measured:.1%}"
        diff = "-" if r.max_loss_diff_vs_smp is None else f"{r.max_loss_diff_vs_smp:.1e}"
        memory = "-" if r.peak_activation_mib is None else "/".join(f"{x:.1f}" for x in r.peak_activation_mib)
        table.append(
            [
                r.name,
                r.schedule + (f" x{v} chunks" if v > 1 else ""),
                f"{r.median_step_s * 1e3:.0f}",
                ratio(r.median_step_s, base.median_step_s if base else None),
                f"{r.min_step_s * 1e3:.0f}",
                ratio(r.min_step_s, base.min_step_s if base else None),
                measured,
                f"{bubble_theory(r.schedule, p, m, v):.1%}",
                memory,
                f"{r.final_loss:.4f}",
                diff,
            ]
        )
    print(format_table(headers, table))
    smp_rows = [r for r in rows if r.name.startswith("smp") and r.bubble_per_stage is not None]
    for smp_row in smp_rows:
        assert smp_row.bubble_per_stage is not None and smp_row.action_ms is not None
        print(
            f"{smp_row.name} bubble per stage (time blocked on receives / step time): "
            + ", ".join(f"stage {i}: {b:.1%}" for i, b in enumerate(smp_row.bubble_per_stage))
            + (
                ""  # chunked schedules time no single actions
                if smp_row.bubble_predicted is None
                else "; F/B/W ms per micro-batch: "
                + ", ".join("/".join(f"{ms[k]:.0f}" for k in "FBW") for ms in smp_row.action_ms)
                + f"; bubble of its lists with these times: {smp_row.bubble_predicted:.1%}"
            )
        )
    _print_smp_ratios(smp_rows)
    if smp_rows:
        returns = "(loss, loss.item())" if settings.smp_item_outputs else "(loss,)"
        share = smp_rows[0].output_share_s or 0.0
        print(
            f"smp step returns {returns}: sharing the outputs from the output stage took {share * 1e3:.2f} ms "
            f"per step (median of the slowest stage), {share / smp_rows[0].median_step_s:.2%} of the step"
        )
    if placement:
        print(placement)
    print("torch.pipelining stages: " + " | ".join(f"blocks {b[0]}-{b[-1]}" for b in split) + " (embedding first)")


def _print_smp_ratios(smp_rows: list[Row]) -> None:
    """Each smp schedule against the first: bubble, peak activation memory (largest stage), median step."""
    if len(smp_rows) < 2:
        return
    first = smp_rows[0]
    for r in smp_rows[1:]:
        assert r.bubble_measured is not None and first.bubble_measured is not None
        assert r.peak_activation_mib is not None and first.peak_activation_mib is not None
        assert r.peak_with_w_grads_mib is not None
        worst = max(a / b for a, b in zip(r.peak_activation_mib, first.peak_activation_mib) if b > 0)
        print(
            f"{r.name} vs {first.name}: bubble {ratio(r.bubble_measured, first.bubble_measured)}, peak activation "
            f"memory (largest stage) {ratio(max(r.peak_activation_mib), max(first.peak_activation_mib))}, on the "
            f"stage it grows most {worst:.2f}x, median step {ratio(r.median_step_s, first.median_step_s)}"
        )
        if r.peak_with_w_grads_mib != r.peak_activation_mib:
            print(
                f"  {r.name} with the gradients kept for W (which the unsplit backward makes too, but only while it "
                "runs, uncounted): " + "/".join(f"{x:.1f}" for x in r.peak_with_w_grads_mib) + " MiB per stage, "
                f"largest {ratio(max(r.peak_with_w_grads_mib), max(first.peak_activation_mib))}"
            )


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
    parser.add_argument("--strategies", default="smp,torch GPipe,torch 1F1B")
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
                "--virtual-stages and the 'zbv' schedule cut the model into their own chunks, which the other smp "
                "schedules cannot share: give one smp schedule per run (torch's run beside it in the same processes)"
            )
        if args.quick:
            settings = replace(settings, lm=QUICK_LM, steps=2, warmup=1)
        settings = replace(
            settings,
            steps=args.steps if args.steps is not None else settings.steps,
            warmup=args.warmup if args.warmup is not None else settings.warmup,
        )
    except ValueError as exc:
        parser.error(f"{exc} (set by --world-size, --microbatches, --steps or --warmup)")
    if settings.stages < 2 or settings.lm.n_layers < settings.stages:
        parser.error(f"--world-size must be between 2 and the number of blocks ({settings.lm.n_layers})")
    if settings.global_batch % settings.microbatches:
        parser.error(
            f"the global batch {settings.global_batch} is not divisible by --microbatches {settings.microbatches}"
        )
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    per_rank = launch_local(_worker, settings.stages, settings, names)
    rows = combine(settings, per_rank)
    _print(settings, rows, per_rank[0].get("placement"), per_rank[0]["split"])
    if args.json:
        write_json(args.json, {"settings": settings, "rows": rows})


if __name__ == "__main__":
    run(sys.argv[1:])
