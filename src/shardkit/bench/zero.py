"""Benchmark suite "zero": every data-parallel strategy of the registry, side by side, on the GPT-style LM.

All strategies are built at once in the same worker processes (each in its own process group) and trained
*interleaved*: step ``s`` of every strategy runs before step ``s + 1`` of any, with the order rotated each step,
so background load on a shared machine hits every strategy alike. Each strategy starts from the same weights
and sees the same batches, so its loss must match DDP's.

Run it as ``shardkit bench zero`` (options: ``--steps``, ``--warmup``, ``--world-size``, ``--strategies``,
``--quick``, ``--json PATH``) or ``python -m shardkit.bench.zero``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from shardkit.demo.task import MarkovTask
from shardkit.launch import launch_local
from shardkit.memory.meter import format_bytes
from shardkit.models import LMConfig, TransformerLM
from shardkit.strategies import registry
from shardkit.strategies.live import (
    PHASES,
    Combined,
    LiveStrategy,
    StrategyResult,
    agree_on_failures,
    combine_all,
    paired_ratio,
    quiet_torch_deprecations,
)
from shardkit.utils.checks import at_least, positive
from shardkit.utils.report import format_table, ratio, unavailable_lines, write_json


@dataclass(frozen=True)
class ZeroSettings:
    """What the suite runs; plain data handed to every worker."""

    strategies: tuple[str, ...]
    lm: LMConfig = field(default_factory=LMConfig.bench)
    #: Sequences per rank per step.
    batch_size: int = 4
    #: Timed steps.
    steps: int = 12
    #: Untimed steps first (allocations, lazy initialisation)
    warmup: int = 3
    #: AdamW learning rate (constant)
    lr: float = 1e-3
    seed: int = 0
    #: A collective stuck this long fails its strategy.
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        at_least(self, "batch_size", self.batch_size, 1)
        at_least(self, "steps", self.steps, 1)
        at_least(self, "warmup", self.warmup, 0)
        positive(self, "lr", self.lr)
        positive(self, "timeout_s", self.timeout_s)


QUICK_LM = LMConfig.quick()


def _batch_seed(seed: int, rank: int, step: int) -> int:
    return (seed * 1_000_003 + rank) * 1_000_003 + step


def _worker(settings: ZeroSettings) -> list[StrategyResult]:
    """One rank: build every strategy, train them interleaved, return their measurements."""
    quiet_torch_deprecations()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    task = MarkovTask.create(settings.lm.vocab_size, seed=settings.seed)
    optim = registry.OptimizerSpec(torch.optim.AdamW, {"lr": settings.lr})

    def model_fn() -> TransformerLM:
        torch.manual_seed(settings.seed)
        return TransformerLM(settings.lm)

    lives = [
        LiveStrategy(registry.get_strategy(name), model_fn, optim, settings.timeout_s) for name in settings.strategies
    ]
    agree_on_failures(lives)
    total = settings.warmup + settings.steps
    progress = _progress(total, rank)
    for step in range(total):
        gen = torch.Generator().manual_seed(_batch_seed(settings.seed, rank, step))
        tokens, targets = task.batch(settings.batch_size, settings.lm.seq_len, gen)
        shift = step % len(lives)
        for live in lives[shift:] + lives[:shift]:
            live.step(tokens, targets, timed=step >= settings.warmup, measure_memory=step == total - 1)
        agree_on_failures(lives)
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    results = [live.finish() for live in lives]
    dist.destroy_process_group()
    return results


def _progress(total: int, rank: int) -> Any:
    if rank != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="zero bench (all strategies per step)", unit="step", file=sys.stderr)


def run_suite(settings: ZeroSettings, world_size: int) -> list[Combined]:
    """Launch ``world_size`` workers with torch's elastic agent and return each strategy's merged results."""
    rank_results = launch_local(_worker, world_size, settings)
    return combine_all(rank_results)


def load_text(when: str) -> str:
    """``'load average at start: 1.23 (1 min), 2 CPUs'``: how busy the machine was, for honest timings."""
    if not hasattr(os, "getloadavg"):
        return ""
    return f"load average at {when}: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs"


def _rows(results: list[Combined]) -> list[list[str]]:
    base = next((r for r in results if r.name == "ddp" and r.error is None), None)
    base_total = base.memory.total if base and base.memory else None
    rows = []
    for r in results:
        if r.error is not None:
            continue
        mem = r.memory
        final = r.losses[-1] if r.losses else float("nan")
        rows.append(
            [
                r.name,
                f"{r.median_step_s * 1000:.0f}",
                f"{r.min_step_s * 1000:.0f}",
                f"{paired_ratio(r.step_times, base.step_times):.2f}x" if base else "-",
                format_bytes(mem.params) if mem else "-",
                format_bytes(mem.grads) if mem else "-",
                format_bytes(mem.optim_state) if mem else "-",
                format_bytes(mem.total) if mem else "-",
                ratio(mem.total if mem else None, base_total),
                format_bytes(r.comm_bytes_per_step),
                r.comm_source,
                f"{final:.6f}",
                f"{final - base.losses[-1]:+.1e}" if base and base.losses else "-",
            ]
        )
    return rows


def _phase_rows(results: list[Combined]) -> list[list[str]]:
    return [
        [r.name, *(f"{r.phase_medians_s[p] * 1000:.0f}" if p in r.phase_medians_s else "-" for p in PHASES)]
        for r in results
        if r.error is None
    ]


HEADERS = [
    "strategy",
    "step ms (median)",
    "min",
    "vs ddp (paired)",
    "params",
    "grads",
    "optim state",
    "p+g+o",
    "vs ddp",
    "comm/step",
    "comm counted by",
    "final loss",
    "loss - ddp",
]


NOTES = [
    "step ms: per step the slowest rank, then the median (and min) over timed steps; phases: forward+loss,",
    "  backward (and the gradient reductions it waits for), optimizer step+zero_grad (and parameter broadcasts).",
    "vs ddp (paired): median over steps of this strategy's time / DDP's time in the same step (robust to",
    "  drifting background load).",
    "params/grads/optim state: bytes one rank holds (the larger rank), counted from the storages of the",
    "  parameters, their .grad and the optimizer state after optimizer.step(); torch DDP's separate gradient",
    "  buckets, activations and transient all-gathered parameters are not counted.",
    "comm/step: bytes on the wire per rank per step (group traffic / n, ring algorithms). 'measured' = shardkit",
    "  collectives counted by count_comm_bytes; 'formula' = torch-internal collectives computed from sizes (DDP",
    "  all-reduce 2(n-1)/n x grads, ZeroRedundancyOptimizer broadcast (n-1)/n x params, torch FSDP gathers).",
]


def report(
    results: list[Combined], missing: dict[str, str], settings: ZeroSettings, world_size: int, load: str = ""
) -> str:
    """The suite's printed output: settings, the table, notes, and what was not available or failed."""
    lm = settings.lm
    lines = [
        f"zero suite: TransformerLM {lm.n_layers} blocks x width {lm.d_model}, {lm.n_heads} heads, vocab "
        f"{lm.vocab_size}, seq {lm.seq_len}; batch {settings.batch_size}/rank; AdamW lr {settings.lr}; world size "
        f"{world_size} ({dist.Backend.GLOO}); {settings.steps} timed steps after {settings.warmup} warm-up, "
        "strategies interleaved step by step",
        load,
        "",
        format_table(HEADERS, _rows(results)),
        "",
        "where the time goes (median ms per phase, slowest rank):",
        "",
        format_table(["strategy", *PHASES], _phase_rows(results)),
        "",
        *NOTES,
    ]
    failed = {r.name: r.error for r in results if r.error is not None}
    extra = unavailable_lines(missing, failed)
    if extra:
        lines += ["", "not run:", *extra]
    lines += _target_lines(results)
    return "\n".join(lines)


def _target_lines(results: list[Combined]) -> list[str]:
    by_name = {r.name: r for r in results if r.error is None}
    base, sdp = by_name.get("ddp"), by_name.get("oss_sdp")
    if base is None or sdp is None or base.memory is None or sdp.memory is None:
        return []
    time_ratio = paired_ratio(sdp.step_times, base.step_times)
    mem_ratio = sdp.memory.total / base.memory.total
    loss_diff = abs(sdp.losses[-1] - base.losses[-1])

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return [
        "",
        f"targets (oss_sdp vs ddp): step time {time_ratio:.2f}x (<= 1.0x: {verdict(time_ratio <= 1.0)}), "
        f"params+grads+optim {mem_ratio:.2f}x (<= 0.65x: {verdict(mem_ratio <= 0.65)}), "
        f"|final loss difference| {loss_diff:.1e}",
    ]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of the suite (also accepted through ``shardkit bench zero ...``)."""
    parser = argparse.ArgumentParser(prog="shardkit bench zero", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per strategy (default 12)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3)")
    parser.add_argument("--strategies", default=None, help="comma-separated subset (default: every available one)")
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps, for tests")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def run(argv: list[str]) -> None:
    """Entry point of the suite: parse ``argv``, run every available strategy, print the table."""
    args = parse_args(argv)
    if args.world_size < 1:
        raise SystemExit(f"--world-size must be at least 1, got {args.world_size}")
    names = args.strategies.split(",") if args.strategies else None
    try:
        available, missing = registry.select(names)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    settings = ZeroSettings(strategies=tuple(s.name for s in available))
    if args.quick:
        settings = replace(settings, lm=QUICK_LM, batch_size=2, steps=3, warmup=1, timeout_s=60.0)
    try:
        if args.steps is not None:
            settings = replace(settings, steps=args.steps)
        if args.warmup is not None:
            settings = replace(settings, warmup=args.warmup)
    except ValueError:
        raise SystemExit("--steps must be at least 1 and --warmup at least 0") from None
    if not available:
        print("zero suite: no strategy available:\n" + "\n".join(unavailable_lines(missing, {})))
        return
    load = load_text("start")
    results = run_suite(settings, args.world_size)
    load += f"; {load_text('end')}"
    print(report(results, missing, settings, args.world_size, load), flush=True)
    if args.json:
        write_json(args.json, {"settings": settings, "results": results, "not_available": missing})


if __name__ == "__main__":
    run(sys.argv[1:])
