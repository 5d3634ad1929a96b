"""Benchmark suite "slowmo": DDP vs LocalSGD, SlowMo+LocalSGD and SGP on the demo's Markov-chain language.

Two runs at world size 4 (``shardkit.launch.launch_local``, gloo):

1. *Accuracy and traffic*: every strategy trains the demo LM from the same weights on the same batches (the
   strategies interleaved step by step, so machine load hits all alike). Reported: held-out loss at the end
   (mean over ranks of each rank's model, against the task's loss floor), mean training loss over the last steps,
   and the bytes one rank sends per step, counted by shardkit's collectives (DDP's gradient all-reduce goes
   through a comm hook that calls shardkit's labelled ``all_reduce``, so it is counted the same way).
2. *Slow network*: a few steps of each strategy under ``shardkit.distributed.comm_delay(latency, bandwidth)``,
   which delays every shardkit collective (DDP's included, through the same hook); reported: wall time per step.

Run it as ``shardkit bench slowmo`` (options ``--steps``, ``--world-size``, ``--strategies``, ``--quick``,
``--json PATH``) or ``python -m shardkit.bench.slowmo``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardkit.bench.ddp_hook import labelled_allreduce_hook
from shardkit.demo.task import MarkovTask
from shardkit.demo.train import DemoSettings
from shardkit.distributed import CommMeter, comm_delay, count_comm_bytes
from shardkit.distributed import collectives as C
from shardkit.launch import launch_local
from shardkit.models import LMConfig, TransformerLM
from shardkit.strategies.live import quiet_torch_deprecations
from shardkit.strategies.registry import Built, OptimizerSpec, get_strategy
from shardkit.utils.checks import at_least, positive
from shardkit.utils.report import format_table, ratio, write_json

STRATEGIES = ("ddp", "localsgd", "slowmo_localsgd", "sgp")


@dataclass(frozen=True)
class SlowMoBenchSettings:
    """What the suite runs; plain data handed to every worker. Model, batches and schedule are the demo's."""

    strategies: tuple[str, ...] = STRATEGIES
    demo: DemoSettings = field(default_factory=lambda: DemoSettings(strategies=(), steps=240))
    #: LocalSGD averaging period (both LocalSGD strategies)
    localsgd_frequency: int = 3
    #: Slow-momentum period of slowmo_localsgd.
    slowmo_frequency: int = 12
    slowmo_momentum: float = 0.5
    #: Held-out batches for the final loss (the same on every rank and strategy)
    eval_batches: int = 8
    #: Timed steps per strategy on the slow network.
    slow_steps: int = 24
    slow_warmup: int = 3
    #: Injected per-collective latency of the slow network.
    latency_s: float = 0.02
    #: Injected bandwidth of the slow network.
    bytes_per_s: float = 25e6

    def __post_init__(self) -> None:
        for name in ("localsgd_frequency", "slowmo_frequency", "eval_batches", "slow_steps"):
            at_least(self, name, getattr(self, name), 1)
        at_least(self, "slow_warmup", self.slow_warmup, 0)
        at_least(self, "slowmo_momentum", self.slowmo_momentum, 0)
        at_least(self, "latency_s", self.latency_s, 0)
        positive(self, "bytes_per_s", self.bytes_per_s)

    @property
    def lm(self) -> LMConfig:
        return self.demo.lm


@dataclass
class Measured:
    """One strategy on one rank; plain data returned to the launcher."""

    name: str
    train_losses: list[float] = field(default_factory=list)
    eval_loss: float = float("nan")
    bytes_per_step: float = 0.0
    slow_step_s: float = float("nan")


class _Trainer:
    """One strategy on this rank: wrapped model, AdamW, and what to call after ``optimizer.step()``."""

    def __init__(self, name: str, settings: SlowMoBenchSettings) -> None:
        self.name = name
        self.group = dist.new_group()
        torch.manual_seed(settings.demo.seed)
        model = TransformerLM(settings.lm)
        self.model, self.optimizer, self.after_step = self._build(name, model, settings)
        self.result = Measured(name)

    def _build(self, name: str, model: nn.Module, s: SlowMoBenchSettings) -> Built:
        """The registry's ddp (its all-reduce labelled) or slowmo with this row's options, AdamW without decay."""
        adamw = OptimizerSpec(torch.optim.AdamW, {"lr": s.demo.lr, "weight_decay": 0.0})
        if name == "ddp":
            built = get_strategy("ddp").build(model, adamw, self.group, {})
            assert isinstance(built[0], DistributedDataParallel)
            built[0].register_comm_hook(self.group, labelled_allreduce_hook)
            return built
        rows: dict[str, dict[str, Any]] = {
            "localsgd": {"slowmo_momentum": 0.0, "slowmo_lr": 1.0},
            "slowmo_localsgd": {"slowmo_momentum": s.slowmo_momentum, "slowmo_frequency": s.slowmo_frequency},
            "sgp": {"slowmo_base_algorithm": "sgp", "slowmo_momentum": 0.0},
        }
        if name not in rows:
            raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
        options = {"localsgd_frequency": s.localsgd_frequency, **rows[name]}
        return get_strategy("slowmo").build(model, adamw, self.group, options)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = TransformerLM.loss_fn(self.model(tokens), targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.after_step()
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss of this rank's model on ``batches`` (eval mode finishes any gossip in flight)."""
        self.model.eval()
        losses = [float(TransformerLM.loss_fn(self.model(t), y)) for t, y in batches]
        self.model.train()
        return sum(losses) / len(losses)


def _batch(task: MarkovTask, s: SlowMoBenchSettings, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed((s.demo.seed * 1_000_003 + rank) * 1_000_003 + step)
    return task.batch(s.demo.batch_size, s.lm.seq_len, gen)


def _accuracy_run(s: SlowMoBenchSettings, task: MarkovTask, rank: int) -> list[Measured]:
    trainers = [_Trainer(name, s) for name in s.strategies]
    meters = {t.name: CommMeter() for t in trainers}
    progress = _progress("slowmo bench: accuracy (all strategies per step)", s.demo.steps, rank)
    for step in range(s.demo.steps):
        tokens, targets = _batch(task, s, rank, step)
        shift = step % len(trainers)
        for trainer in trainers[shift:] + trainers[:shift]:
            with count_comm_bytes(meters[trainer.name]):
                trainer.result.train_losses.append(trainer.step(tokens, targets, s.demo.lr_at(step)))
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    held_out = [_batch(task, s, 10_000 + i, 0) for i in range(s.eval_batches)]
    for trainer in trainers:
        trainer.result.eval_loss = trainer.evaluate(held_out)
        trainer.result.bytes_per_step = meters[trainer.name].total_wire_bytes / s.demo.steps
    return [t.result for t in trainers]


def _slow_network_run(s: SlowMoBenchSettings, task: MarkovTask, rank: int) -> dict[str, float]:
    times: dict[str, float] = {}
    progress = _progress("slowmo bench: slow network (one strategy at a time)", len(s.strategies), rank)
    for name in s.strategies:
        trainer = _Trainer(name, s)
        start = time.perf_counter()
        with comm_delay(s.latency_s, s.bytes_per_s):
            for step in range(s.slow_warmup + s.slow_steps):
                if step == s.slow_warmup:
                    C.barrier(trainer.group, "bench.slow_network")
                    start = time.perf_counter()
                trainer.step(*_batch(task, s, rank, step), s.demo.lr_at(step))
            C.barrier(trainer.group, "bench.slow_network")
        times[name] = (time.perf_counter() - start) / s.slow_steps
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    return times


def _progress(desc: str, total: int, rank: int) -> Any:
    if rank != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)


def _worker(s: SlowMoBenchSettings) -> list[Measured]:
    quiet_torch_deprecations()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    task = MarkovTask.create(s.lm.vocab_size, s.demo.branching, seed=s.demo.task_seed)
    results = _accuracy_run(s, task, rank)
    slow = _slow_network_run(s, task, rank)
    for result in results:
        result.slow_step_s = slow[result.name]
    dist.destroy_process_group()
    return results


def _combine(per_rank: list[list[Measured]]) -> list[Measured]:
    """Mean over ranks (losses, bytes); the slowest rank's step time."""
    combined = []
    for i, first in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        n = len(ranks)
        combined.append(
            Measured(
                first.name,
                train_losses=[sum(r.train_losses[k] for r in ranks) / n for k in range(len(first.train_losses))],
                eval_loss=sum(r.eval_loss for r in ranks) / n,
                bytes_per_step=sum(r.bytes_per_step for r in ranks) / n,
                slow_step_s=max(r.slow_step_s for r in ranks),
            )
        )
    return combined


def report(results: list[Measured], s: SlowMoBenchSettings, world_size: int, floor: float) -> str:
    """The suite's tables and the verdict on its targets."""
    base = next((r for r in results if r.name == "ddp"), None)
    window = s.demo.eval_window
    rows = []
    for r in results:
        train = sum(r.train_losses[-window:]) / len(r.train_losses[-window:])
        rows.append(
            [
                r.name,
                f"{r.eval_loss:.4f}",
                ratio(r.eval_loss, base.eval_loss if base else None),
                f"{train:.4f}",
                f"{r.bytes_per_step / 1e6:.3f}",
                ratio(r.bytes_per_step, base.bytes_per_step if base else None),
                f"{r.slow_step_s * 1000:.0f}",
                ratio(r.slow_step_s, base.slow_step_s if base else None),
            ]
        )
    headers = ["strategy", "final loss", "vs ddp", f"train loss (last {window})", "MB sent/step", "vs ddp"]
    headers += ["slow-net ms/step", "vs ddp"]
    lm = s.lm
    lines = [
        f"slowmo suite: TransformerLM {lm.n_layers} blocks x width {lm.d_model}, vocab {lm.vocab_size}, seq "
        f"{lm.seq_len}; Markov language with loss floor {floor:.4f} nats; batch {s.demo.batch_size}/rank; AdamW "
        f"lr {s.demo.lr} (warm-up + cosine); {s.demo.steps} steps; world size {world_size} (gloo, 1 process per "
        f"node); LocalSGD every {s.localsgd_frequency} steps; SlowMo every {s.slowmo_frequency} steps, momentum "
        f"{s.slowmo_momentum}, lr 1.0, memory-efficient; SGP: default graph (1 peer/round), push-sum.",
        "",
        format_table(headers, rows),
        "",
        f"final loss: held-out loss after training, mean over ranks of each rank's model ({s.eval_batches} batches). "
        "MB sent/step: bytes one rank sends per step through shardkit collectives (DDP: its gradient all-reduce, "
        f"via a comm hook). slow-net: {s.slow_steps} steps after {s.slow_warmup} warm-up under "
        f"comm_delay({s.latency_s * 1000:.0f} ms latency, {s.bytes_per_s / 1e6:.0f} MB/s), slowest rank.",
    ]
    return "\n".join(lines + _verdict(results))


def _verdict(results: list[Measured]) -> list[str]:
    by_name = {r.name: r for r in results}
    base, slow = by_name.get("ddp"), by_name.get("slowmo_localsgd")
    if base is None or slow is None:
        return []
    loss_gap = slow.eval_loss / base.eval_loss - 1
    traffic = slow.bytes_per_step / base.bytes_per_step
    speed = slow.slow_step_s / base.slow_step_s

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return [
        "",
        f"targets (slowmo_localsgd vs ddp): final loss {loss_gap:+.2%} (within 2%: {met(abs(loss_gap) <= 0.02)}), "
        f"bytes/step {traffic:.3f}x (<= 1/3: {met(traffic <= 1 / 3)}), slow-network time/step {speed:.2f}x "
        f"(< 1: {met(speed < 1)})",
    ]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of the suite (also accepted through ``shardkit bench slowmo ...``)."""
    parser = argparse.ArgumentParser(prog="shardkit bench slowmo", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per strategy (default 240)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed slow-network steps first (default 3)")
    parser.add_argument("--strategies", default=None, help=f"comma-separated subset of {', '.join(STRATEGIES)}")
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps (seconds), for tests")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args, _unknown = parser.parse_known_args(argv)
    return args


def settings_from_args(args: argparse.Namespace) -> SlowMoBenchSettings:
    """Suite settings for parsed options (raises SystemExit on bad values)."""
    s = SlowMoBenchSettings()
    if args.strategies:
        names = tuple(n.strip() for n in args.strategies.split(",") if n.strip())
        unknown = [n for n in names if n not in STRATEGIES]
        if unknown:
            raise SystemExit(f"unknown slowmo bench strategies {unknown}; choose from {', '.join(STRATEGIES)}")
        s = replace(s, strategies=names)
    if args.quick:
        quick_lm = LMConfig(vocab_size=32, d_model=32, n_heads=4, n_layers=1, seq_len=16)
        s = replace(s, demo=replace(s.demo, lm=quick_lm, batch_size=8, steps=24, warmup_steps=3, eval_window=6))
        s = replace(s, slow_steps=6, slow_warmup=1, eval_batches=2)
    if args.steps is not None:
        if args.steps < 1:
            raise SystemExit(f"--steps must be at least 1, got {args.steps}")
        s = replace(s, demo=replace(s.demo, steps=args.steps))
    if args.warmup is not None:
        s = replace(s, slow_warmup=max(0, args.warmup))
    return s


def run(argv: list[str]) -> None:
    """Run the suite with command-line options ``argv`` and print its tables."""
    args = parse_args(argv)
    if args.world_size < 2:
        raise SystemExit(
            f"the slowmo suite compares averaging between ranks: --world-size must be >= 2, got {args.world_size}"
        )
    s = settings_from_args(args)
    task = MarkovTask.create(s.lm.vocab_size, s.demo.branching, seed=s.demo.task_seed)
    floor = task.entropy_rate()
    start = time.perf_counter()
    results = _combine(launch_local(_worker, args.world_size, s))
    print(report(results, s, args.world_size, floor), flush=True)
    print(f"\n(suite wall time {time.perf_counter() - start:.0f} s)", flush=True)
    if args.json:
        write_json(args.json, {"settings": s, "floor": floor, "results": results})


if __name__ == "__main__":
    run(sys.argv[1:])
