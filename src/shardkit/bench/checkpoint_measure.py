"""Workers of ``shardkit bench checkpoint``: build each strategy, save and load it, and measure every rank.

:func:`worker` runs on each rank (``shardkit.launch.launch_local``, gloo): per strategy it trains two steps, then
measures the save, the export, the load (and checks it restores the saved parameters), the old way of saving and
the async save, each phase's rise of resident memory taken with :class:`~shardkit.bench.rss.PeakRSS`. The tables
and the command line are in :mod:`shardkit.bench.checkpoint`.

Example::

    per_rank = launch_local(worker, 2, CheckpointBenchSettings(layers=2, width=64), "/tmp/ckpt-bench")
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit import checkpoint
from shardkit.bench.rss import PeakRSS, current_rss
from shardkit.checkpoint import load_checkpoint, save_checkpoint
from shardkit.checkpoint.adapters.fsdp_legacy import FSDPAdapter
from shardkit.checkpoint.tools.export import export_safetensors
from shardkit.distributed import collectives as C
from shardkit.memory.meter import training_memory
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.strategies.live import quiet_torch_deprecations
from shardkit.utils.checks import at_least

STRATEGIES = ("fsdp", "oss_sdp")
#: Largest safetensors shard of the export phase.
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
        torch.manual_seed(0)
        # each layer is sharded as soon as it is built, so no rank ever holds the whole model
        layers = [FSDP(nn.Linear(s.width, s.width)) for _ in range(s.layers)]
        model: nn.Module = FSDP(nn.Sequential(*layers))
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)

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
        FSDPAdapter(model, optimizer).save(directory, rank)
        return
    optimizer.consolidate_state_dict(recipient_rank=0)
    if rank == 0:
        net = model.module  # ShardedDataParallel's wrapped model
        assert isinstance(net, nn.Module)
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, directory / "old.pt")


def _measure(name: str, s: CheckpointBenchSettings, root: Path) -> RankResult:
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


def worker(s: CheckpointBenchSettings, root: str) -> list[RankResult]:
    quiet_torch_deprecations()
    dist.init_process_group("gloo")
    try:
        return [_measure(name, s, Path(root)) for name in s.strategies]
    finally:
        dist.destroy_process_group()
