"""``shardkit demo``: train the small LM on the Markov-chain language with every available strategy.

Two local worker processes are started by torch's elastic agent (:func:`shardkit.launch.launch_local`). Each
strategy of the registry in turn trains a fresh copy of the same model on the same batches; rank 0 shows a
progress bar. At the end a table shows, per strategy, the loss reached against the task's known floor, the step
time and the per-rank memory of parameters, gradients and optimizer state.

The "final loss" is the mean global-batch loss over the last steps. Every batch is freshly sampled and the loss
is taken before the model updates on it, so it estimates the expected loss on new text, directly comparable to
the floor (up to batch noise of about +-0.01 nats with the default settings).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit import restarts
from shardkit.demo.task import MarkovTask, uniform_loss
from shardkit.launch import launch_local
from shardkit.memory.meter import format_bytes
from shardkit.models import LMConfig, TransformerLM
from shardkit.strategies import registry
from shardkit.strategies.live import (
    Combined,
    LiveStrategy,
    StrategyResult,
    agree_on_failures,
    combine_all,
    quiet_torch_deprecations,
)
from shardkit.utils.checks import at_least, positive
from shardkit.utils.report import format_table, ratio, unavailable_lines, write_json


@dataclass(frozen=True)
class DemoSettings:
    """What the demo trains; plain data handed to every worker."""

    strategies: tuple[str, ...]
    lm: LMConfig = field(default_factory=LMConfig.demo)
    #: Sequences per rank per step.
    batch_size: int = 16
    steps: int = 300
    #: Peak AdamW learning rate.
    lr: float = 6e-3
    #: Linear warm-up, then cosine decay to ``final_lr_fraction`` of the peak.
    warmup_steps: int = 20
    final_lr_fraction: float = 0.1
    #: Successors per token in the Markov chain.
    branching: int = 4
    task_seed: int = 0
    seed: int = 0
    #: The final loss is the mean over this many last steps.
    eval_window: int = 30
    #: First steps left out of the step time (allocation, lazy initialisation)
    untimed_steps: int = 5
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("batch_size", "steps", "branching", "eval_window"):
            at_least(self, name, getattr(self, name), 1)
        for name in ("warmup_steps", "untimed_steps"):
            at_least(self, name, getattr(self, name), 0)
        positive(self, "lr", self.lr)
        positive(self, "timeout_s", self.timeout_s)
        if not 0.0 <= self.final_lr_fraction <= 1.0:
            raise ValueError(f"DemoSettings.final_lr_fraction must be in [0, 1], got {self.final_lr_fraction!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate of ``step`` (0-based): linear warm-up, then cosine decay."""
        warm = min(1.0, (step + 1) / max(1, self.warmup_steps))
        progress = step / max(1, self.steps)
        floor = self.final_lr_fraction
        return self.lr * warm * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def quick(settings: DemoSettings) -> DemoSettings:
    """Tiny settings that run in seconds (for tests): a one-block model on a 32-token language."""
    return replace(
        settings,
        lm=LMConfig(vocab_size=32, d_model=32, n_heads=4, n_layers=1, seq_len=16),
        batch_size=8,
        steps=30,
        lr=1e-2,
        warmup_steps=3,
        eval_window=5,
        untimed_steps=2,
        timeout_s=60.0,
    )


def _batch_seed(seed: int, rank: int, step: int) -> int:
    return (seed * 1_000_003 + rank) * 1_000_003 + step


def _train_one(name: str, settings: DemoSettings, task: MarkovTask, rank: int) -> StrategyResult:
    """Train one strategy for ``settings.steps`` steps on this rank."""
    optim = registry.OptimizerSpec(torch.optim.AdamW, {"lr": settings.lr, "weight_decay": 0.0})

    def model_fn() -> TransformerLM:
        torch.manual_seed(settings.seed)
        return TransformerLM(settings.lm)

    live = LiveStrategy(registry.get_strategy(name), model_fn, optim, settings.timeout_s)
    agree_on_failures([live])
    progress = _progress(name, settings.steps, rank) if live.ok else None
    for step in range(settings.steps):
        gen = torch.Generator().manual_seed(_batch_seed(settings.seed, rank, step))
        tokens, targets = task.batch(settings.batch_size, settings.lm.seq_len, gen)
        live.set_lr(settings.lr_at(step))
        live.step(tokens, targets, timed=step >= settings.untimed_steps, measure_memory=step == settings.steps - 1)
        agree_on_failures([live])
        if not live.ok:
            break
        if progress is not None:
            progress.update(1)
            if step % 10 == 9:
                recent = live.result.losses[-10:]
                progress.set_postfix(loss=f"{sum(recent) / len(recent):.3f}", refresh=False)
    if progress is not None:
        progress.close()
    return live.finish()


def _progress(name: str, total: int, rank: int) -> Any:
    if rank != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{name:<16}", unit="step", file=sys.stderr, leave=True)


def _worker(settings: DemoSettings) -> list[StrategyResult]:
    """One rank: train every strategy in turn and return their measurements."""
    quiet_torch_deprecations()
    restarts.init_process_group("gloo", timedelta(minutes=30))
    rank = dist.get_rank()
    task = MarkovTask.create(settings.lm.vocab_size, settings.branching, seed=settings.task_seed)
    results = [_train_one(name, settings, task, rank) for name in settings.strategies]
    dist.destroy_process_group()
    return results


def final_loss(result: Combined, window: int) -> float:
    """Mean global-batch loss over the last ``window`` steps."""
    tail = result.losses[-window:]
    return sum(tail) / len(tail) if tail else float("nan")


def report(results: list[Combined], missing: dict[str, str], settings: DemoSettings, floor: float) -> str:
    """The table the demo ends with, plus what was not available or failed."""
    base = next((r for r in results if r.name == "ddp" and r.error is None and r.memory), None)
    rows = []
    for r in results:
        if r.error is not None:
            continue
        loss = final_loss(r, settings.eval_window)
        rows.append(
            [
                r.name,
                f"{r.losses[0]:.3f}" if r.losses else "-",
                f"{loss:.4f}",
                f"{floor:.4f}",
                f"{loss - floor:+.4f}",
                f"{r.median_step_s * 1000:.1f}",
                format_bytes(r.memory.total) if r.memory else "-",
                ratio(r.memory.total if r.memory else None, base.memory.total if base and base.memory else None),
            ]
        )
    headers = ["strategy", "first loss", "final loss", "floor", "gap", "step ms", "params+grads+optim", "vs ddp"]
    lines = ["", format_table(headers, rows)]
    failed = {r.name: r.error for r in results if r.error is not None}
    extra = unavailable_lines(missing, failed)
    if extra:
        lines += ["", "not run:", *extra]
    lines += [
        "",
        f"final loss: mean over the last {settings.eval_window} steps (fresh batches). floor: the chain's entropy "
        "rate, the lowest loss any model can reach; a uniform guess scores "
        f"{uniform_loss(settings.lm.vocab_size):.3f}.",
        "step ms: median over steps of the slower rank. Memory: per rank, counted from the tensors held.",
    ]
    return "\n".join(lines)


def run_demo(settings: DemoSettings, world_size: int = 2) -> list[Combined]:
    """Launch the workers and return each strategy's merged results."""
    return combine_all(launch_local(_worker, world_size, settings))


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of ``shardkit demo``."""
    parser = argparse.ArgumentParser(prog="shardkit demo", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per strategy (default 300)")
    parser.add_argument("--strategies", default=None, help="comma-separated subset (default: every available one)")
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps, for tests")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    """Run the demo from command-line arguments and print its table."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.world_size < 1:
        raise SystemExit(f"--world-size must be at least 1, got {args.world_size}")
    try:
        available, missing = registry.select(args.strategies.split(",") if args.strategies else None)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    settings = DemoSettings(strategies=tuple(s.name for s in available))
    if args.quick:
        settings = quick(settings)
    if args.steps is not None:
        if args.steps < 1:
            raise SystemExit(f"--steps must be at least 1, got {args.steps}")
        settings = replace(settings, steps=args.steps)
    task = MarkovTask.create(settings.lm.vocab_size, settings.branching, seed=settings.task_seed)
    floor = task.entropy_rate()
    print(
        f"shardkit demo: {settings.lm.n_layers}-block LM (width {settings.lm.d_model}) learns a Markov-chain language "
        f"over {task.vocab_size} tokens ({settings.branching} successors each); lowest achievable loss "
        f"{floor:.4f} nats. {world_size_text(args.world_size)}, {settings.steps} steps of "
        f"{settings.batch_size} sequences/rank per strategy.",
        flush=True,
    )
    if not available:
        print("no strategy available:\n" + "\n".join(unavailable_lines(missing, {})))
        return
    results = run_demo(settings, args.world_size)
    print(report(results, missing, settings, floor), flush=True)
    if args.json:
        payload = {"settings": settings, "floor": floor, "results": results, "not_available": missing}
        write_json(args.json, payload)


def world_size_text(world_size: int) -> str:
    """``'2 processes (gloo)'``."""
    return f"{world_size} process{'es' if world_size != 1 else ''} (gloo)"


if __name__ == "__main__":
    main()
