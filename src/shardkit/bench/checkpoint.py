"""Benchmark suite "checkpoint": host memory of every rank while saving and loading a large sharded model.

A stack of ``Linear(width, width)`` layers (default 16 x 4096: 1.07 GB of FP32 parameters) with Adam state, at
world size 4 (``shardkit.launch.launch_local``, gloo, CPU), under FSDP (each layer its own unit) and OSS +
ShardedDataParallel. For each strategy and rank, measured side by side in one run:

- **save** and **load**: the rise of the process's resident memory (RSS) above what it held just before the call,
  at its peak during ``save_checkpoint`` / ``load_checkpoint`` (the kernel's high-water mark, reset before each
  phase through ``/proc/self/clear_refs``, or else a 2 ms sampling thread; freed heap memory is first returned to
  the OS with ``malloc_trim``, so a phase cannot hide in memory an earlier one freed), against 256 MiB: the
  staging the universal layout may use beyond what the rank holds anyway (its parameters and optimizer state:
  FSDP its shards, OSS every parameter and its optimizer partition), so the peak stays within holds + 256 MiB.
- **old way**: the same rise for what shardkit did before the universal layout (FSDP: parameters through DCP and
  the whole optimizer state gathered on rank 0; OSS: ``consolidate_state_dict`` on rank 0 and ``torch.save``).
- **async save**: how long ``save_checkpoint(..., async_save=True)`` stalls training (until it returns) against
  a synchronous save, and a training step's time with the background write running (when the engine offers it).

Run it as ``shardkit bench checkpoint`` (``--world-size``, ``--layers``, ``--width``, ``--strategies``,
``--quick``, ``--json PATH``, ``--dir PATH`` for where checkpoints go) or ``python -m shardkit.bench.checkpoint``.
The full size needs about 4 x 0.8 GB for FSDP and 4 x 2.7 GB for OSS + SDP plus the checkpoint on disk; run it
on a quiet machine.
"""

from __future__ import annotations

import argparse
import inspect
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.bench.memory import format_bytes, training_memory
from shardkit.bench.report import format_table, ratio, write_json
from shardkit.bench.rss import PeakRSS, current_rss
from shardkit.bench.runner import quiet_torch_deprecations
from shardkit.distributed import collectives as C
from shardkit.launch import launch_local
from shardkit.utils.checks import at_least

STRATEGIES = ("fsdp", "oss_sdp")
SLACK_BYTES = 256 * 1024**2
EXPORT_SHARD_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class CheckpointBenchSettings:
    """What the suite runs; plain data handed to every worker."""

    strategies: tuple[str, ...] = STRATEGIES
    #: Linear layers in the stack.
    layers: int = 16
    #: Width of each square Linear layer.
    width: int = 4096
    #: Rows of the random batch of one training step.
    batch: int = 4
    #: Where checkpoints are written (a temporary folder under it, removed afterwards).
    directory: str = tempfile.gettempdir()
    #: Run the old (gather on rank 0) save for comparison.
    old_way: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "width", "batch"):
            at_least(self, name, getattr(self, name), 1)
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise ValueError(f"strategies must be a non-empty subset of {STRATEGIES}, got {self.strategies}")

    @property
    def parameters(self) -> int:
        """Parameters of the model (weights and biases)."""
        return self.layers * (self.width * self.width + self.width)


@dataclass
class RankResult:
    """One rank's measurements for one strategy (bytes and seconds)."""

    strategy: str
    rank: int
    owned_bytes: int = 0
    baseline_rss: int = 0
    save_rise: int = 0
    load_rise: int = 0
    old_rise: Optional[int] = None
    save_s: float = 0.0
    load_s: float = 0.0
    old_s: Optional[float] = None
    step_s: float = 0.0
    async_stall_s: Optional[float] = None
    async_step_s: Optional[float] = None
    async_total_s: Optional[float] = None
    async_rise: Optional[int] = None
    loaded_equal: bool = False
    #: Rank 0 only: ``shardkit checkpoint export`` of the model into shards of ``EXPORT_SHARD_BYTES``.
    export_rise: Optional[int] = None
    export_s: Optional[float] = None
    notes: list[str] = field(default_factory=list)


def _model(s: CheckpointBenchSettings) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(s.width, s.width) for _ in range(s.layers)])


def _build(name: str, s: CheckpointBenchSettings) -> tuple[nn.Module, torch.optim.Optimizer]:
    if name == "fsdp":
        from shardkit.nn import FullyShardedDataParallel as FSDP

        torch.manual_seed(0)
        # each layer is sharded as soon as it is built, so no rank ever holds the whole model
        layers = [FSDP(nn.Linear(s.width, s.width)) for _ in range(s.layers)]
        model: nn.Module = FSDP(nn.Sequential(*layers))
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    from shardkit.nn import ShardedDataParallel
    from shardkit.optim import OSS

    net = _model(s)
    optimizer = OSS(net.parameters(), optim=torch.optim.Adam, lr=1e-4)
    return ShardedDataParallel(net, optimizer), optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, s: CheckpointBenchSettings, seed: int) -> float:
    torch.manual_seed(seed + dist.get_rank())
    start = time.perf_counter()
    model(torch.randn(s.batch, s.width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _owned_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters and optimizer state this rank holds between steps (FSDP: its shards; OSS: every parameter,
    which it trains, and its partition of the optimizer state)."""
    memory = training_memory(model, optimizer)
    return memory.params + memory.optim_state


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _timed(fn: Callable[[], Any]) -> tuple[float, int]:
    C.barrier(None, "bench checkpoint: phase")
    with PeakRSS() as peak:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, peak.rise


def _old_save(name: str, model: nn.Module, optimizer: Any, directory: Path) -> None:
    """What shardkit did before the universal layout for this strategy."""
    rank = dist.get_rank()
    if name == "fsdp":
        from shardkit.checkpoint.adapters.fsdp_legacy import FSDPAdapter

        FSDPAdapter(model, optimizer).save(directory, rank)
        return
    optimizer.consolidate_state_dict(recipient_rank=0)
    if rank == 0:
        net = model.module  # ShardedDataParallel's wrapped model
        assert isinstance(net, nn.Module)
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, directory / "old.pt")


def _measure(name: str, s: CheckpointBenchSettings, root: Path) -> RankResult:
    from shardkit.checkpoint import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    result = RankResult(name, rank)
    model, optimizer = _build(name, s)
    _step(model, optimizer, s, 0)
    result.step_s = _step(model, optimizer, s, 1)
    result.owned_bytes = _owned_bytes(model, optimizer)
    result.baseline_rss = current_rss()
    saved = _snapshot(model)
    path = root / f"{name}_sync"
    result.save_s, result.save_rise = _timed(lambda: save_checkpoint(path, step=1, model=model, optimizer=optimizer))
    _export(result, path, root / f"{name}_export")
    _step(model, optimizer, s, 2)  # move away from the saved state, so the load has something to restore
    result.load_s, result.load_rise = _timed(lambda: load_checkpoint(path, model=model, optimizer=optimizer))
    result.loaded_equal = all(torch.equal(a, b) for a, b in zip(_snapshot(model), saved))
    del saved
    if s.old_way:
        old = root / f"{name}_old"
        if rank == 0:
            old.mkdir(parents=True, exist_ok=True)
        C.barrier(None, "bench checkpoint: old directory")
        old_s, result.old_rise = _timed(lambda: _old_save(name, model, optimizer, old))
        result.old_s = old_s
    _async(result, model, optimizer, s, root / f"{name}_async")
    C.barrier(None, "bench checkpoint: done")
    if rank == 0:  # free the disk before the next strategy
        for written in root.glob(f"{name}_*"):
            shutil.rmtree(written, ignore_errors=True)
    return result


def _export(result: RankResult, path: Path, out: Path) -> None:
    """Rank 0 exports the checkpoint's model as safetensors shards (the others wait): memory stays at a shard."""
    from shardkit.checkpoint.tools.export import export_safetensors

    C.barrier(None, "bench checkpoint: export")
    if result.rank == 0:
        with PeakRSS() as peak:
            start = time.perf_counter()
            export_safetensors(path, out, max_shard_bytes=EXPORT_SHARD_BYTES)
            result.export_s = time.perf_counter() - start
        result.export_rise = peak.rise
        shutil.rmtree(out, ignore_errors=True)
    C.barrier(None, "bench checkpoint: export done")


def _async(result: RankResult, model: nn.Module, optimizer: Any, s: CheckpointBenchSettings, path: Path) -> None:
    from shardkit import checkpoint

    if "async_save" not in inspect.signature(checkpoint.save_checkpoint).parameters:
        result.notes.append("save_checkpoint has no async_save here")
        return
    wait: Callable[[], Any] = checkpoint.wait_for_checkpoint
    C.barrier(None, "bench checkpoint: async memory")
    with PeakRSS() as peak:  # staging and background write alone: the staged copy lives until the write ends
        checkpoint.save_checkpoint(path, step=2, model=model, optimizer=optimizer, async_save=True)
        wait()
    result.async_rise = peak.rise
    C.barrier(None, "bench checkpoint: async stall")
    start = time.perf_counter()
    checkpoint.save_checkpoint(path, step=3, model=model, optimizer=optimizer, async_save=True)
    result.async_stall_s = time.perf_counter() - start
    result.async_step_s = _step(model, optimizer, s, 3)  # runs while the background write goes on
    wait()
    result.async_total_s = time.perf_counter() - start


def _worker(s: CheckpointBenchSettings, root: str) -> list[RankResult]:
    quiet_torch_deprecations()
    dist.init_process_group("gloo")
    try:
        return [_measure(name, s, Path(root)) for name in s.strategies]
    finally:
        dist.destroy_process_group()


def _mib(nbytes: Optional[float]) -> str:
    return "-" if nbytes is None else format_bytes(nbytes)


def report(per_rank: list[list[RankResult]], s: CheckpointBenchSettings, world_size: int) -> str:
    """The tables: per strategy and rank, memory rises against the bound; then save and stall times."""
    rows, times = [], []
    for index, name in enumerate(s.strategies):
        ranks = [r[index] for r in per_rank]
        for r in ranks:
            bound = SLACK_BYTES  # the rise is on top of what the rank holds: the peak stays within holds + this
            worst = max(r.save_rise, r.load_rise)
            rows.append(
                [
                    f"{name} rank {r.rank}",
                    _mib(r.owned_bytes),
                    _mib(r.save_rise),
                    _mib(r.load_rise),
                    ratio(worst, bound),
                    "yes" if worst <= bound else "NO",
                    _mib(r.old_rise),
                    ratio(r.old_rise, r.save_rise) if r.old_rise is not None else "-",
                ]
            )
        slowest = max(ranks, key=lambda r: r.save_s)
        stall = max((r.async_stall_s for r in ranks if r.async_stall_s is not None), default=None)
        times.append(
            [
                name,
                f"{max(r.step_s for r in ranks):.2f}",
                f"{slowest.save_s:.2f}",
                f"{max(r.load_s for r in ranks):.2f}",
                "-" if ranks[0].old_s is None else f"{max(r.old_s or 0.0 for r in ranks):.2f}",
                "-" if stall is None else f"{stall:.2f}",
                ratio(stall, slowest.save_s),
                "-" if ranks[0].async_step_s is None else f"{max(r.async_step_s or 0.0 for r in ranks):.2f}",
                _mib(max((r.async_rise for r in ranks if r.async_rise is not None), default=None)),
                "yes" if all(r.loaded_equal for r in ranks) else "NO",
            ]
        )
    header = (
        f"checkpoint suite: {s.layers} x Linear({s.width}, {s.width}) = {s.parameters * 4 / 1e9:.2f} GB FP32 "
        f"parameters + Adam ({s.parameters * 8 / 1e9:.2f} GB), world size {world_size} (gloo, CPU)"
    )
    notes = sorted({n for ranks in per_rank for r in ranks for n in r.notes})
    for index, name in enumerate(s.strategies):
        first = per_rank[0][index]
        if first.export_rise is not None and first.export_s is not None:
            notes.append(
                f"{name}: shardkit checkpoint export of the model into {format_bytes(EXPORT_SHARD_BYTES)} safetensors "
                f"shards (rank 0): {first.export_s:.1f} s, RSS rise {format_bytes(first.export_rise)} "
                f"(model {format_bytes(s.parameters * 4)})"
            )
    return "\n".join(
        [
            header,
            "",
            format_table(
                [
                    "rank",
                    "holds",
                    "save rise",
                    "load rise",
                    "worst rise / 256MiB",
                    "within",
                    "old-way rise",
                    "old / save",
                ],
                rows,
            ),
            "",
            format_table(
                [
                    "strategy",
                    "step s",
                    "save s",
                    "load s",
                    "old save s",
                    "async stall s",
                    "stall / save",
                    "step during async s",
                    "async rise (max rank)",
                    "load restores",
                ],
                times,
            ),
            "",
            "rise: peak RSS during the call minus RSS just before it. holds: parameters + optimizer state this rank "
            "keeps between steps (FSDP: shards; OSS: all parameters + its optimizer partition). old way: FSDP's "
            "previous adapter (optimizer state gathered on rank 0) / OSS consolidate_state_dict + torch.save on "
            "rank 0. async rise: the same rise from save_checkpoint(async_save=True) until wait_for_checkpoint() "
            "returns (staging and background write, no training in between); async stall: time until the call "
            "returns, after which a training step runs beside the background write.",
            *notes,
        ]
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of the suite (also accepted through ``shardkit bench checkpoint ...``)."""
    parser = argparse.ArgumentParser(prog="shardkit bench checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--layers", type=int, default=None, help="Linear layers (default 16)")
    parser.add_argument("--width", type=int, default=None, help="layer width (default 4096)")
    parser.add_argument("--strategies", default=None, help=f"comma-separated subset of {', '.join(STRATEGIES)}")
    parser.add_argument("--no-old-way", action="store_true", help="skip the gather-on-rank-0 comparison")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp folder)")
    parser.add_argument("--quick", action="store_true", help="tiny model (seconds), for tests")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args, _unknown = parser.parse_known_args(argv)
    return args


def settings_from_args(args: argparse.Namespace) -> CheckpointBenchSettings:
    """Suite settings for parsed options (SystemExit with the reason on bad values)."""
    s = CheckpointBenchSettings(layers=2, width=64) if args.quick else CheckpointBenchSettings()
    try:
        if args.strategies:
            s = replace(s, strategies=tuple(n.strip() for n in args.strategies.split(",") if n.strip()))
        if args.layers is not None:
            s = replace(s, layers=args.layers)
        if args.width is not None:
            s = replace(s, width=args.width)
        if args.dir is not None:
            s = replace(s, directory=args.dir)
        return replace(s, old_way=not args.no_old_way)
    except ValueError as err:
        raise SystemExit(f"shardkit bench checkpoint: {err}") from None


def run(argv: list[str]) -> None:
    """Run the suite with command-line options ``argv`` and print its tables."""
    args = parse_args(argv)
    if args.world_size < 1:
        raise SystemExit(f"--world-size must be at least 1, got {args.world_size}")
    s = settings_from_args(args)
    root = Path(tempfile.mkdtemp(prefix="shardkit-bench-ckpt-", dir=s.directory))
    start = time.perf_counter()
    try:
        per_rank = launch_local(_worker, args.world_size, s, str(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(per_rank, s, args.world_size), flush=True)
    print(f"\n(suite wall time {time.perf_counter() - start:.0f} s)", flush=True)
    if args.json:
        write_json(args.json, {"settings": s, "ranks": per_rank})


if __name__ == "__main__":
    run(sys.argv[1:])
