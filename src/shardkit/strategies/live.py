"""Worker-side pieces shared by the benchmark and the demo: train one strategy step by step, and measure it.

Inside an initialised process group, :class:`LiveStrategy` builds one registry strategy on a fresh model (in its
own process group, so strategies trained in turn never see each other's collectives) and :meth:`~LiveStrategy.step`
runs one training step, recording its time, loss, shardkit collective bytes and, when asked, the memory it
holds. A strategy that raises is marked failed instead of ending the run; :func:`agree_on_failures` makes every
rank drop it together. :func:`combine` merges the ranks' :class:`StrategyResult` objects in the launching
process.
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from statistics import median
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed import CommMeter, collectives, count_comm_bytes
from shardkit.memory.meter import MemoryBreakdown, training_memory
from shardkit.models import TransformerLM
from shardkit.strategies.options import nothing
from shardkit.strategies.registry import OptimizerSpec, Strategy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: The phases of a timed step: forward + loss, backward (with the reductions it overlaps), step + zero_grad.
PHASES = ("forward", "backward", "optimizer")


@dataclass
class StrategyResult:
    """What one strategy did on one rank; plain data, so workers can return it to the launcher."""

    name: str
    step_times: list[float] = field(default_factory=list)
    #: Host time of each phase of each timed step (see :data:`PHASES`); on CUDA, kernels may finish later.
    phase_times: dict[str, list[float]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    memory: Optional[MemoryBreakdown] = None
    meter_bytes_per_step: int = 0
    formula_bytes_per_step: Optional[int] = None
    error: Optional[str] = None


def _short_error(exc: BaseException) -> str:
    """The exception and the innermost frame it came from, on one line."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}".replace("\n", " ")


def quiet_torch_deprecations() -> None:
    """Hide torch's "`torch.distributed.X` is deprecated" FutureWarnings in worker output (one per rank and op).

    They concern which torch API a strategy calls, not the run; the demo's table should not drown in them.
    """
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def _sync_device(model: nn.Module) -> None:
    """Wait for queued device work before reading the clock (a no-op on CPU)."""
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        torch.cuda.synchronize(param.device)


class LiveStrategy:
    """One strategy being trained on this rank: its group, wrapped model, optimizer and measurements.

    Example::

        live = LiveStrategy(get_strategy("ddp"), lambda: TransformerLM(cfg), OptimizerSpec(), timeout_s=60)
        live.step(tokens, targets, timed=True, measure_memory=False)
        result = live.finish()
    """

    def __init__(
        self,
        strategy: Strategy,
        model_fn: Callable[[], nn.Module],
        optim: OptimizerSpec,
        timeout_s: float,
        loss_fn: LossFn = TransformerLM.loss_fn,
    ) -> None:
        self.strategy = strategy
        self.loss_fn = loss_fn
        self.result = StrategyResult(strategy.name)
        self._meter = CommMeter()
        self._metered_steps = 0
        # Every rank creates every group in the same order, even if building then fails on it.
        self.group = dist.new_group(timeout=timedelta(seconds=timeout_s))
        self.model: Optional[nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.after_step: Callable[[], None] = nothing
        try:
            model = model_fn()
            if strategy.torch_comm is not None:
                self.result.formula_bytes_per_step = strategy.torch_comm(model, dist.get_world_size(self.group))
            with count_comm_bytes(self._meter):  # construction traffic (initial syncs) is not a step's
                self.model, self.optimizer, self.after_step = strategy.build(model, optim, self.group)
            self._meter.reset()
        except Exception as exc:
            self.fail(exc)

    @property
    def ok(self) -> bool:
        """Built and has not failed."""
        return self.result.error is None

    def fail(self, exc: BaseException) -> None:
        """Record ``exc`` and release the model and optimizer (their memory goes back at once)."""
        if self.result.error is None:
            self.result.error = _short_error(exc)
        self.model = None
        self.optimizer = None

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group, as torch's LR schedulers do."""
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, *, timed: bool, measure_memory: bool) -> None:
        """One training step; records the loss, and the time and comm bytes when ``timed``."""
        if self.model is None or self.optimizer is None:
            return
        model, optimizer = self.model, self.optimizer
        try:
            device = next(model.parameters()).device
            tokens, targets = tokens.to(device), targets.to(device)
            # Start together, so the time is this step's and not a straggler's.
            collectives.barrier(self.group, "bench.step_start")
            with count_comm_bytes(self._meter if timed else CommMeter()):
                start = time.perf_counter()
                loss = self.loss_fn(model(tokens), targets)
                forward_end = time.perf_counter()
                loss.backward()
                backward_end = time.perf_counter()
                optimizer.step()
                self.after_step()
                step_end = time.perf_counter()
                if measure_memory:  # between step and zero_grad: gradients and state both present
                    self.result.memory = training_memory(model, optimizer)
                resume = time.perf_counter()
                optimizer.zero_grad()
                _sync_device(model)
                end = time.perf_counter()
            self.result.losses.append(float(loss.detach()))
            if timed:
                phases = (forward_end - start, backward_end - forward_end, step_end - backward_end + end - resume)
                self.result.step_times.append(sum(phases))
                for name, seconds in zip(PHASES, phases):
                    self.result.phase_times.setdefault(name, []).append(seconds)
                self._metered_steps += 1
        except Exception as exc:
            self.fail(exc)

    def finish(self) -> StrategyResult:
        """The measurements, with shardkit collective bytes averaged over the timed steps."""
        if self._metered_steps:
            self.result.meter_bytes_per_step = self._meter.total_wire_bytes // self._metered_steps
        self.model = None
        self.optimizer = None
        return self.result


def agree_on_failures(lives: Sequence[LiveStrategy]) -> None:
    """Fail, on every rank, each strategy that failed on any rank (one small all-reduce on the world group)."""
    flags = torch.tensor([0 if live.ok else 1 for live in lives], dtype=torch.int32)
    collectives.all_reduce(flags, op=dist.ReduceOp.MAX, label="bench.agree_on_failures")
    for live, flag in zip(lives, flags.tolist()):
        if flag and live.ok:
            live.fail(RuntimeError("failed on another rank"))


@dataclass(frozen=True)
class Combined:
    """One strategy's measurements merged over ranks, as the tables show them.

    Step time: per step the slowest rank (``step_times``), then the median and minimum over steps. Loss: per
    step the mean over ranks (the loss of the global batch). Memory and comm: the rank that holds or sends the
    most.
    """

    name: str
    median_step_s: float
    min_step_s: float
    step_times: list[float]
    phase_medians_s: dict[str, float]
    losses: list[float]
    memory: Optional[MemoryBreakdown]
    comm_bytes_per_step: int
    comm_source: str
    error: Optional[str]


def combine(per_rank: Sequence[StrategyResult]) -> Combined:
    """Merge the ranks' results for one strategy (see :class:`Combined`)."""
    first = per_rank[0]
    errors = [r.error for r in per_rank if r.error and r.error != "RuntimeError: failed on another rank"]
    error = errors[0] if errors else next((r.error for r in per_rank if r.error), None)
    times = [max(ts) for ts in zip(*(r.step_times for r in per_rank))]
    losses = [sum(ls) / len(ls) for ls in zip(*(r.losses for r in per_rank))]
    memories = [r.memory for r in per_rank if r.memory is not None]
    memory = max(memories, key=lambda m: m.total) if memories else None
    meter = max(r.meter_bytes_per_step for r in per_rank)
    formula = first.formula_bytes_per_step
    if formula is None:
        source = "measured"
    else:
        source = "formula" if meter == 0 else "measured+formula"
    return Combined(
        name=first.name,
        median_step_s=median(times) if times else float("nan"),
        min_step_s=min(times) if times else float("nan"),
        step_times=times,
        phase_medians_s=_phase_medians(per_rank),
        losses=losses,
        memory=memory,
        comm_bytes_per_step=meter + (formula or 0),
        comm_source=source,
        error=error,
    )


def _phase_medians(per_rank: Sequence[StrategyResult]) -> dict[str, float]:
    """Per phase: each step's slowest rank, then the median over steps."""
    medians = {}
    for phase in PHASES:
        series = [r.phase_times.get(phase, []) for r in per_rank]
        per_step = [max(ts) for ts in zip(*series)]
        if per_step:
            medians[phase] = median(per_step)
    return medians


def paired_ratio(times: Sequence[float], base_times: Sequence[float]) -> float:
    """Median over steps of ``times[s] / base_times[s]``.

    When strategies run interleaved, step ``s`` of each ran within seconds of the others, so the per-step ratio
    cancels slow drifts in background load that a ratio of medians would pick up.
    """
    ratios = [t / b for t, b in zip(times, base_times) if b > 0]
    return median(ratios) if ratios and len(times) == len(base_times) else float("nan")


def combine_all(rank_results: Sequence[Sequence[StrategyResult]]) -> list[Combined]:
    """Merge every strategy's results; ``rank_results[rank]`` lists that rank's results in strategy order."""
    return [combine(list(same)) for same in zip(*rank_results)]
