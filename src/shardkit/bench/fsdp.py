"""Benchmark suite "fsdp": shardkit's ZeRO-3 next to torch FSDP2, torch FSDP1 and DDP on the bench LM.

Three parts, all in the same worker processes (gloo):

1. **Speed**, as the zero suite measures it: every strategy built at once, trained interleaved step by step
   from the same weights on the same batches (so background load hits all alike); median step time of the
   slowest rank, ratio to DDP, bytes one rank sends per step, final loss.
2. **Memory**, per strategy on its own, under :class:`~shardkit.memory.MemoryTracker` from before the model is
   built: steady-state parameters + gradients + optimizer state after ``optimizer.step()``, and the peak of all
   tensor storage (activations, gathered parameters, communication buffers included) over one training step
   after a warm-up step.
3. **Prefetch under a slow network**: shardkit FSDP without prefetch, with ``BACKWARD_PRE``, and with
   ``BACKWARD_PRE`` + ``forward_prefetch``, under :func:`~shardkit.distributed.comm_delay` (which slows
   shardkit's own collectives asynchronously, as a real link would), with their peaks.

Run it as ``shardkit bench fsdp`` or ``python -m shardkit.bench.fsdp`` (options: ``--steps``, ``--warmup``,
``--world-size``, ``--strategies``, ``--quick``, ``--no-memory``, ``--delay-steps``, ``--json PATH``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.demo.task import MarkovTask
from shardkit.distributed import comm_delay
from shardkit.launch import launch_local
from shardkit.memory import Category, MemoryTracker
from shardkit.memory.meter import format_bytes
from shardkit.models import Block, LMConfig, TransformerLM
from shardkit.nn.fsdp import BackwardPrefetch
from shardkit.strategies import registry
from shardkit.strategies.live import Combined, LiveStrategy, agree_on_failures, combine_all, quiet_torch_deprecations
from shardkit.utils.checks import at_least, positive
from shardkit.utils.report import format_table, ratio, unavailable_lines, write_json

DEFAULT_STRATEGIES = ("ddp", "fsdp", "fsdp_no_reshard", "torch_fsdp2", "torch_fsdp1")
QUICK_LM = LMConfig.quick()
STEADY = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


@dataclass(frozen=True)
class FsdpSettings:
    """What the suite runs; plain data handed to every worker."""

    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    lm: LMConfig = field(default_factory=LMConfig.bench)
    #: Sequences per rank per step.
    batch_size: int = 4
    #: Timed steps (speed part)
    steps: int = 12
    #: Untimed steps first.
    warmup: int = 3
    #: AdamW learning rate.
    lr: float = 1e-3
    seed: int = 0
    timeout_s: float = 300.0
    #: Run the memory part.
    memory: bool = True
    #: Timed steps of the slow-network part (0: skip it)
    delay_steps: int = 6
    #: Per collective.
    delay_latency_s: float = 0.005
    #: Simulated bandwidth of the slow link.
    delay_bytes_per_s: float = 200e6

    def __post_init__(self) -> None:
        at_least(self, "batch_size", self.batch_size, 1)
        at_least(self, "steps", self.steps, 1)
        at_least(self, "warmup", self.warmup, 0)
        at_least(self, "delay_steps", self.delay_steps, 0)
        at_least(self, "delay_latency_s", self.delay_latency_s, 0)
        for name in ("lr", "timeout_s", "delay_bytes_per_s"):
            positive(self, name, getattr(self, name))


@dataclass(frozen=True)
class MemoryResult:
    """One strategy's tracked memory on one rank."""

    name: str
    #: Category -> bytes after optimizer.step()
    steady: dict[str, int]
    #: Highest total over a training step.
    peak: int
    peak_by_category: dict[str, int]
    error: Optional[str] = None

    @property
    def steady_total(self) -> int:
        return sum(self.steady.get(c.value, 0) for c in STEADY)


def prefetch_variants() -> list[registry.Strategy]:
    """shardkit FSDP (reshard after forward) without prefetch, with BACKWARD_PRE, and with both prefetches."""

    pre = BackwardPrefetch.BACKWARD_PRE
    variants: list[tuple[str, dict[str, Any]]] = [
        ("no prefetch", {}),
        ("BACKWARD_PRE", {"backward_prefetch": pre}),
        ("BACKWARD_PRE + forward", {"backward_prefetch": pre, "forward_prefetch": True}),
    ]
    # Auto-wrapped per block (the registry's fsdp builder), the same units the zero suite's fsdp row has.
    fsdp = registry.get_strategy("fsdp")
    return [fsdp.variant(name, name, **kwargs) for name, kwargs in variants]


def _batch(task: MarkovTask, settings: FsdpSettings, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed((settings.seed * 1_000_003 + rank) * 1_000_003 + step)
    return task.batch(settings.batch_size, settings.lm.seq_len, gen)


def _train_interleaved(
    strategies: list[registry.Strategy],
    settings: FsdpSettings,
    task: MarkovTask,
    steps: int,
    warmup: int,
    link: Optional[tuple[float, float]] = None,
) -> list[Any]:
    rank = dist.get_rank()
    optim = registry.OptimizerSpec(torch.optim.AdamW, {"lr": settings.lr})

    def model_fn() -> TransformerLM:
        torch.manual_seed(settings.seed)
        return TransformerLM(settings.lm)

    lives = [LiveStrategy(s, model_fn, optim, settings.timeout_s) for s in strategies]
    agree_on_failures(lives)
    for step in range(warmup + steps):
        tokens, targets = _batch(task, settings, rank, step)
        shift = step % len(lives)
        for live in lives[shift:] + lives[:shift]:
            with comm_delay(*link) if link else _nothing():
                live.step(tokens, targets, timed=step >= warmup, measure_memory=False)
        agree_on_failures(lives)
    return [live.finish() for live in lives]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def measure_memory(
    strategy: registry.Strategy, model_fn: Callable[[], nn.Module], settings: FsdpSettings, task: MarkovTask
) -> MemoryResult:
    """Build ``strategy`` under a tracker; one warm-up step, then the peak of one step and the steady state."""
    group = dist.new_group(timeout=timedelta(seconds=settings.timeout_s))
    rank = dist.get_rank()
    optim_spec = registry.OptimizerSpec(torch.optim.AdamW, {"lr": settings.lr})
    try:
        with MemoryTracker() as tracker:
            model, optim, _ = strategy.build(model_fn(), optim_spec, group)
            tracker.watch(model, optim)
            steady: dict[str, int] = {}
            for step in range(2):
                tokens, targets = _batch(task, settings, rank, step)
                TransformerLM.loss_fn(model(tokens), targets).backward()
                optim.step()
                if step == 1:
                    steady = {c.value: n for c, n in tracker.current.by_category.items()}
                optim.zero_grad()
                if step == 0:
                    tracker.reset_peak()
            peak = tracker.peak
        del model, optim
        return MemoryResult(strategy.name, steady, peak.total, {c.value: n for c, n in peak.by_category.items()})
    except Exception as exc:  # report, never end the run
        return MemoryResult(strategy.name, {}, 0, {}, error=f"{type(exc).__name__}: {exc}")


def _worker(settings: FsdpSettings) -> dict[str, Any]:
    quiet_torch_deprecations()
    dist.init_process_group("gloo")
    task = MarkovTask.create(settings.lm.vocab_size, seed=settings.seed)
    strategies = [registry.get_strategy(name) for name in settings.strategies]
    out: dict[str, Any] = {"speed": _train_interleaved(strategies, settings, task, settings.steps, settings.warmup)}

    def model_fn() -> TransformerLM:
        torch.manual_seed(settings.seed)
        return TransformerLM(settings.lm)

    if settings.memory:
        out["memory"] = [measure_memory(s, model_fn, settings, task) for s in strategies]
    if settings.delay_steps > 0:
        variants = prefetch_variants()
        link = (settings.delay_latency_s, settings.delay_bytes_per_s)
        out["delay"] = _train_interleaved(variants, settings, task, settings.delay_steps, 1, link)
        out["delay_memory"] = [measure_memory(v, model_fn, settings, task) for v in variants]
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------------------------- report
def _mib(nbytes: Optional[int]) -> str:
    return format_bytes(nbytes) if nbytes else "-"


def _largest(per_rank: list[list[MemoryResult]]) -> list[MemoryResult]:
    """Per strategy, the rank with the highest peak."""
    return [max(same, key=lambda m: m.peak) for same in zip(*per_rank)]


def speed_table(speed: list[Combined], memory: list[MemoryResult], world_size: int) -> str:
    """Main table: time, memory and communication per strategy, with ratios to DDP and to torch FSDP2."""
    by_name = {m.name: m for m in memory if m.error is None}
    base = next((r for r in speed if r.name == "ddp" and r.error is None), None)
    ddp_mem, fsdp2_mem = by_name.get("ddp"), by_name.get("torch_fsdp2")
    rows = []
    for r in speed:
        if r.error is not None:
            continue
        mem = by_name.get(r.name)
        steady = mem.steady_total if mem else None
        rows.append(
            [
                r.name,
                f"{r.median_step_s * 1000:.0f}",
                f"{r.min_step_s * 1000:.0f}",
                ratio(r.median_step_s, base.median_step_s if base else None),
                _mib(steady),
                ratio(steady, ddp_mem.steady_total / world_size if ddp_mem else None),
                _mib(mem.peak if mem else None),
                ratio(mem.peak if mem else None, fsdp2_mem.peak if fsdp2_mem else None),
                format_bytes(r.comm_bytes_per_step),
                r.comm_source,
                f"{r.losses[-1]:.6f}" if r.losses else "-",
            ]
        )
    headers = ["strategy", "step ms (median)", "min", "vs ddp", "p+g+o steady", "vs ddp/ws", "peak"]
    headers += ["vs fsdp2", "comm/step", "comm counted by", "final loss"]
    return format_table(headers, rows)


def delay_table(delay: list[Combined], memory: list[MemoryResult]) -> str:
    """Prefetch variants under the simulated slow link: time and peak, relative to no prefetch."""
    by_name = {m.name: m for m in memory if m.error is None}
    base = next((r for r in delay if r.error is None), None)
    base_mem = by_name.get(base.name) if base else None
    rows = []
    for r in delay:
        if r.error is not None:
            continue
        mem = by_name.get(r.name)
        extra = mem.peak - base_mem.peak if mem and base_mem else None
        rows.append(
            [
                r.name,
                f"{r.median_step_s * 1000:.0f}",
                f"{r.min_step_s * 1000:.0f}",
                ratio(r.median_step_s, base.median_step_s if base else None),
                _mib(mem.peak if mem else None),
                "-" if extra is None else f"{extra / 2**20:+.1f} MiB",
            ]
        )
    headers = ["shardkit FSDP", "step ms (median)", "min", "vs no prefetch", "peak", "peak - no prefetch"]
    return format_table(headers, rows)


def load_text() -> str:
    if not hasattr(os, "getloadavg"):
        return "load average: unknown"
    return f"load average {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs"


def report(results: dict[str, Any], settings: FsdpSettings, world_size: int, missing: dict[str, str]) -> str:
    """The suite's printed output."""
    lm = settings.lm
    block = sum(p.numel() * p.element_size() for p in Block(lm).parameters())
    lines = [
        f"fsdp suite: TransformerLM {lm.n_layers} blocks x width {lm.d_model}, vocab {lm.vocab_size}, seq "
        f"{lm.seq_len}; batch {settings.batch_size}/rank; AdamW; world size {world_size} (gloo); "
        f"{settings.steps} timed steps after {settings.warmup} warm-up, interleaved; {results['load']}",
        "",
        speed_table(results["speed"], results.get("memory", []), world_size),
        "",
        "step ms: per step the slowest rank, median (and min) over timed steps. p+g+o steady: parameters +",
        "  gradients + optimizer state after optimizer.step() (shardkit.memory tracker, larger rank); vs ddp/ws:",
        "  relative to DDP's divided by the world size. peak: all tensor storage at its highest over one step",
        "  after a warm-up step (activations, gathered parameters, communication buffers included).",
        "  comm/step: bytes one rank sends per step ('measured': shardkit collectives; 'formula': torch's).",
    ]
    if "delay" in results:
        lines += [
            "",
            f"prefetch under comm_delay(latency {settings.delay_latency_s * 1000:.0f} ms, "
            f"{settings.delay_bytes_per_s / 1e6:.0f} MB/s) on shardkit collectives; one block's full "
            f"parameters = {block / 2**20:.1f} MiB:",
            "",
            delay_table(results["delay"], results.get("delay_memory", [])),
        ]
    failed = {r.name: r.error for r in results["speed"] + results.get("delay", []) if r.error is not None}
    failed.update({m.name: f"memory: {m.error}" for m in results.get("memory", []) if m.error})
    extra = unavailable_lines(missing, failed)
    if extra:
        lines += ["", "not run:", *extra]
    return "\n".join(lines)


def run_suite(settings: FsdpSettings, world_size: int) -> dict[str, Any]:
    """Launch the workers and merge their results."""
    load = load_text()
    per_rank = launch_local(_worker, world_size, settings)
    results: dict[str, Any] = {"speed": combine_all([r["speed"] for r in per_rank])}
    if settings.memory:
        results["memory"] = _largest([r["memory"] for r in per_rank])
    if settings.delay_steps > 0:
        results["delay"] = combine_all([r["delay"] for r in per_rank])
        results["delay_memory"] = _largest([r["delay_memory"] for r in per_rank])
    results["load"] = f"{load} at start, {load_text()} at end"
    return results


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shardkit bench fsdp", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 12)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3)")
    parser.add_argument("--strategies", default=None, help=f"comma-separated (default {','.join(DEFAULT_STRATEGIES)})")
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps, for tests")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory part")
    parser.add_argument("--delay-steps", type=int, default=None, help="timed steps under comm_delay (0: skip)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def run(argv: list[str]) -> None:
    """Entry point: parse ``argv``, run the three parts, print the tables."""
    args = parse_args(argv)
    names = args.strategies.split(",") if args.strategies else list(DEFAULT_STRATEGIES)
    try:
        available, missing = registry.select(names)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    settings = FsdpSettings(strategies=tuple(s.name for s in available), memory=not args.no_memory)
    if args.quick:
        settings = replace(settings, lm=QUICK_LM, batch_size=2, steps=2, warmup=1, delay_steps=2, timeout_s=60.0)
    try:
        if args.steps is not None:
            settings = replace(settings, steps=args.steps)
        if args.warmup is not None:
            settings = replace(settings, warmup=args.warmup)
        if args.delay_steps is not None:
            settings = replace(settings, delay_steps=args.delay_steps)
    except ValueError as exc:
        raise SystemExit(f"fsdp suite: {exc} (set by --steps, --warmup or --delay-steps)") from None
    if not available:
        raise SystemExit("fsdp suite: no strategy available:\n" + "\n".join(unavailable_lines(missing, {})))
    results = run_suite(settings, args.world_size)
    print(report(results, settings, args.world_size, missing), flush=True)
    if args.json:
        write_json(args.json, {"settings": settings, "results": results, "not_available": missing})


if __name__ == "__main__":
    run(sys.argv[1:])
