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
``(p - 1) / (m + p - 1)``.

Run it as ``shardkit bench pipeline`` (options ``--steps``, ``--warmup``, ``--world-size``, ``--quick``,
``--microbatches``, ``--smp-pipeline simple|interleaved``, ``--smp-item-outputs``, ``--json PATH``) or
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
from torch import nn

from shardkit.bench.report import format_table, ratio, write_json
from shardkit.bench.runner import quiet_torch_deprecations
from shardkit.demo.task import MarkovTask
from shardkit.distributed import collectives
from shardkit.launch import launch_local
from shardkit.testing.models import LMConfig, TransformerLM
from shardkit.utils.checks import at_least, positive

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
    #: Auto-partition balancing compute (memory_weight 0.2)
    smp_optimize: str = "speed"
    #: smp's step also returns ``loss.item()``: every step then broadcasts one small object over the stages.
    smp_item_outputs: bool = False

    def __post_init__(self) -> None:
        for name in ("stages", "batch_per_rank", "microbatches", "steps"):
            at_least(self, name, getattr(self, name), 1)
        at_least(self, "warmup", self.warmup, 0)
        positive(self, "lr", self.lr)

    @property
    def global_batch(self) -> int:
        """Sequences per step, over all micro-batches."""
        return self.batch_per_rank * self.stages


class _FirstStage(nn.Module):
    def __init__(self, lm: TransformerLM, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed, self.pos, self.blocks = lm.embed, lm.pos, nn.ModuleList(blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return x


class _MiddleStage(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _LastStage(_MiddleStage):
    def __init__(self, lm: TransformerLM, blocks: list[nn.Module]) -> None:
        super().__init__(blocks)
        self.ln_f, self.head = lm.ln_f, lm.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(super().forward(x)))


def _block_split(n_layers: int, stages: int, placement: Any = None) -> list[range]:
    """Blocks per stage: the cut smp's auto-partition chose (when it kept the embedding first and the output
    projection last, as torch's stages here do), else an even split."""
    if placement is not None:
        per_stage = [
            [int(n.split(".")[1]) for n in placement.modules_on(s) if n.startswith("blocks.")] for s in range(stages)
        ]
        flat = [b for blocks in per_stage for b in blocks]
        ends_ok = placement.stage_of("embed") == 0 and placement.stage_of("head") == stages - 1
        if ends_ok and flat == list(range(n_layers)) and all(per_stage):
            return [range(blocks[0], blocks[-1] + 1) for blocks in per_stage]
    edges = [round(i * n_layers / stages) for i in range(stages + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


class _TorchPipeline:
    """One torch.distributed.pipelining schedule over this rank's stage of the bench LM."""

    def __init__(
        self, schedule_cls: Any, settings: PipelineSettings, group: Any, tied_group: Any, placement: Any = None
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        rank, n = dist.get_rank(), settings.stages
        self.tied: Optional[torch.Tensor] = None
        lm = _build_lm(settings)
        blocks = [lm.blocks[i] for i in _block_split(settings.lm.n_layers, n, placement)[rank]]
        if rank == 0:
            module: nn.Module = _FirstStage(lm, blocks)
            self.tied = lm.embed.weight
        elif rank == n - 1:
            module = _LastStage(lm, blocks)
            self.tied = lm.head.weight
        else:
            module = _MiddleStage(blocks)
        del lm
        self.rank, self.last, self.module, self.tied_group = rank, rank == n - 1, module, tied_group
        stage = PipelineStage(module, rank, n, torch.device("cpu"), group=group)
        self.schedule = schedule_cls(stage, settings.microbatches, loss_fn=TransformerLM.loss_fn)
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=settings.lr)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step; returns the mean loss on the last stage (NaN elsewhere)."""
        self.optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(tokens)
        elif self.last:
            self.schedule.step(target=targets, losses=losses, return_outputs=False)
        else:
            self.schedule.step()
        if self.tied is not None and self.tied.grad is not None:  # embedding and output projection are one weight
            collectives.all_reduce(self.tied.grad, group=self.tied_group, label="bench.tied_grad")
        self.optimizer.step()
        return float(torch.stack(losses).mean()) if losses else float("nan")


class _SmpPipeline:
    """The smp pipeline over the bench LM (auto-partitioned)."""

    def __init__(self, settings: PipelineSettings) -> None:
        import shardkit.modelparallel as smp

        smp.init(
            {
                "partitions": settings.stages,
                "microbatches": settings.microbatches,
                "pipeline": settings.smp_pipeline,
                "optimize": settings.smp_optimize,
            }
        )
        self.smp = smp
        self.model = smp.DistributedModel(_build_lm(settings), trace_device="cpu")
        self.optimizer = smp.DistributedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=settings.lr))
        self.waits: list[float] = []
        self.shares: list[float] = []

        @smp.step
        def train_step(model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
            loss = TransformerLM.loss_fn(model(tokens), targets)
            model.backward(loss)
            return (loss, loss.item()) if settings.smp_item_outputs else (loss,)

        @smp.step
        def forward_only(model: Any, tokens: torch.Tensor) -> None:
            model(tokens)

        self.train_step = train_step
        self.forward_only = forward_only

    def partition(self, tokens: torch.Tensor) -> None:
        """A forward-only step: partitions the model without changing it."""
        with torch.no_grad():
            self.forward_only(self.model, tokens)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step; returns the mean loss (on every stage)."""
        self.optimizer.zero_grad()
        loss = self.train_step(self.model, tokens, targets)[0].reduce_mean().item()
        self.optimizer.step()
        self.waits.append(self.model.last_step_stats.bubble_fraction)
        self.shares.append(self.model.last_step_stats.share_s)
        return float(loss)


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
    if "smp" in names:  # smp partitions on its first step; torch's stages then get the same cut
        lives["smp"] = _SmpPipeline(settings)
        tokens, _ = task.batch(settings.global_batch, settings.lm.seq_len, torch.Generator().manual_seed(0))
        lives["smp"].partition(tokens)
        placement = lives["smp"].model.placement
    torch_schedules = {"torch GPipe": ScheduleGPipe, "torch 1F1B": Schedule1F1B}
    for name in names:
        if name in torch_schedules:
            group = dist.new_group(list(range(n)))
            lives[name] = _TorchPipeline(torch_schedules[name], settings, group, tied_group, placement)
        elif name != "smp":
            raise ValueError(f"unknown strategy {name!r}; known: smp, {', '.join(torch_schedules)}")
    times: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    for step in range(settings.warmup + settings.steps):
        gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
        tokens, targets = task.batch(settings.global_batch, settings.lm.seq_len, gen)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            collectives.barrier(bench_group, "bench.step_start")
            start = time.perf_counter()
            loss = lives[name].step(tokens, targets)
            elapsed = time.perf_counter() - start
            if step >= settings.warmup:
                times[name].append(elapsed)
            losses[name].append(loss)
    result: dict[str, Any] = {"rank": rank, "times": times, "losses": losses}
    result["split"] = [list(r) for r in _block_split(settings.lm.n_layers, n, placement)]
    if "smp" in lives:
        smp_live = lives["smp"]
        result["smp_wait"] = smp_live.waits[settings.warmup :]
        result["smp_share"] = smp_live.shares[settings.warmup :]
        result["placement"] = str(smp_live.model.placement)
        smp_live.smp.reset()
    dist.destroy_process_group()
    return result


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


def combine(settings: PipelineSettings, per_rank: list[dict[str, Any]]) -> list[Row]:
    """Per strategy: median over steps of the slowest rank's time; the last stage's losses; smp's bubble."""
    rows = []
    last = per_rank[-1]
    names = list(last["times"])
    for name in names:
        step_times = [max(r["times"][name][i] for r in per_rank) for i in range(settings.steps)]
        losses = last["losses"][name]
        diff = None
        if "smp" in last["losses"] and name != "smp":
            diff = max(abs(a - b) for a, b in zip(losses, last["losses"]["smp"]))
        bubble = per_stage = share = None
        if name == "smp":
            per_stage = [statistics.fmean(r["smp_wait"]) for r in per_rank]
            bubble = statistics.fmean(per_stage)
            share = statistics.median(max(r["smp_share"][i] for r in per_rank) for i in range(settings.steps))
        schedule = {"smp": settings.smp_pipeline, "torch GPipe": "GPipe", "torch 1F1B": "1F1B"}[name]
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
            )
        )
    return rows


def _print(settings: PipelineSettings, rows: list[Row], placement: Optional[str], split: list[list[int]]) -> None:
    p, m = settings.stages, settings.microbatches
    theory = (p - 1) / (m + p - 1)
    base = next((r for r in rows if r.name == "torch 1F1B"), None)
    print(
        f"pipeline: LM {settings.lm.n_layers} blocks x d{settings.lm.d_model}, vocab {settings.lm.vocab_size}, "
        f"seq {settings.lm.seq_len}; {p} stages x {m} micro-batches, global batch {settings.global_batch}; gloo/CPU; "
        f"median of {settings.steps} steps after {settings.warmup} warm-up; load average {os.getloadavg()[0]:.1f}"
    )
    headers = ["strategy", "schedule", "median ms", "vs torch 1F1B", "min ms", "vs torch 1F1B (min)"]
    headers += ["bubble measured", "bubble theory", "loss", "loss diff"]
    table = []
    for r in rows:
        measured = "-" if r.bubble_measured is None else f"{r.bubble_measured:.1%}"
        diff = "-" if r.max_loss_diff_vs_smp is None else f"{r.max_loss_diff_vs_smp:.1e}"
        table.append(
            [
                r.name,
                r.schedule,
                f"{r.median_step_s * 1e3:.0f}",
                ratio(r.median_step_s, base.median_step_s if base else None),
                f"{r.min_step_s * 1e3:.0f}",
                ratio(r.min_step_s, base.min_step_s if base else None),
                measured,
                f"{theory:.1%}",
                f"{r.final_loss:.4f}",
                diff,
            ]
        )
    print(format_table(headers, table))
    smp_row = next((r for r in rows if r.name == "smp"), None)
    if smp_row is not None and smp_row.bubble_per_stage is not None:
        print(
            "smp bubble per stage (time blocked on receives / step time): "
            + ", ".join(f"stage {i}: {b:.1%}" for i, b in enumerate(smp_row.bubble_per_stage))
        )
        returns = "(loss, loss.item())" if settings.smp_item_outputs else "(loss,)"
        share = smp_row.output_share_s or 0.0
        print(
            f"smp step returns {returns}: sharing the outputs from the output stage took {share * 1e3:.2f} ms "
            f"per step (median of the slowest stage), {share / smp_row.median_step_s:.2%} of the step"
        )
    if placement:
        print(placement)
    print("torch.pipelining stages: " + " | ".join(f"blocks {b[0]}-{b[-1]}" for b in split) + " (embedding first)")


def run(argv: list[str]) -> None:
    """Entry point of ``shardkit bench pipeline``."""
    parser = argparse.ArgumentParser(prog="shardkit bench pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="pipeline stages = processes (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (default 2)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--smp-pipeline", choices=("interleaved", "simple"), default="interleaved")
    parser.add_argument("--smp-optimize", choices=("speed", "memory"), default="speed")
    parser.add_argument("--smp-item-outputs", action="store_true", help="smp's step also returns loss.item()")
    parser.add_argument("--strategies", default="smp,torch GPipe,torch 1F1B")
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps (seconds), for tests")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    try:
        settings = PipelineSettings(
            stages=args.world_size,
            microbatches=args.microbatches,
            smp_pipeline=args.smp_pipeline,
            smp_optimize=args.smp_optimize,
            smp_item_outputs=args.smp_item_outputs,
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
