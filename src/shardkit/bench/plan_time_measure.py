"""Measurements behind ``shardkit bench plan-time``: the cost model's constants on this machine, and real steps.

:func:`calibrate_device` times one workload in this process on one thread (what each rank of the real runs gets),
each constant from its own measurement: FLOP/s from forward + backward, memory bandwidth from the optimizer step,
copy bandwidth from one large tensor copy. :func:`calibrate_link` times gloo collectives on ``world_size``
processes. :func:`time_steps` trains each strategy on ``world_size`` gloo processes and times whole steps and
their phases, with a barrier before each step so every rank starts together, the strategies taking turns step by
step.

Example::

    work = Workload.demo_lm(batch_size=4)
    device = calibrate_device(work)
    link = calibrate_link(world_size=2)
    steps = time_steps(work, [Variant("ddp", "ddp")], world_size=2, warmup=2, steps=5)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from statistics import median, quantiles
from typing import Any, Callable, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

from shardkit.distributed import collectives
from shardkit.distributed.spawn import run_distributed
from shardkit.memory.meter import training_memory
from shardkit.plan.runner import call_model
from shardkit.plan.strategies import Built, get
from shardkit.plan.workloads import Workload
from shardkit.strategies.registry import OptimizerSpec


@dataclass(frozen=True)
class Variant:
    """One row of the table: a label, the planner's strategy name and its strategy options."""

    label: str
    strategy: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceCalibration:
    """One thread of this machine running one workload, as the cost model's :class:`DeviceSpec` sees a device."""

    #: FlopCounterMode FLOPs of one forward + backward, and the median wall seconds it took.
    flops: float
    compute_s: float
    #: Bytes the optimizer step reads and writes (2 x parameters + gradients + state), and its median seconds.
    optimizer_bytes: int
    optimizer_s: float
    #: Bytes of one large copy (read + written once) and its median seconds.
    copy_bytes: int
    copy_s: float

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.compute_s

    @property
    def memory_bytes_per_s(self) -> float:
        return self.optimizer_bytes / self.optimizer_s

    @property
    def copy_bytes_per_s(self) -> float:
        return self.copy_bytes / self.copy_s


@dataclass(frozen=True)
class LinkCalibration:
    """gloo over loopback at one world size, in the cost model's convention (bytes each rank sends, ring)."""

    world_size: int
    #: Median seconds of a one-element all-reduce: the fixed cost of a collective.
    latency_s: float
    #: The same for an all-gather of one element per rank by direct sends (FSDP's gather on gloo); printed only:
    #: the model has one fixed cost.
    gather_latency_s: float
    #: Bytes each rank sends in the large all-reduce (2(n-1)/n x payload) and its median seconds.
    all_reduce_bytes: int
    all_reduce_s: float
    #: Bytes each rank sends in the large all-gather ((n-1)/n x output; direct sends, as FSDP gathers on gloo).
    all_gather_bytes: int
    all_gather_s: float

    @property
    def all_reduce_bytes_per_s(self) -> float:
        return self.all_reduce_bytes / max(self.all_reduce_s - self.latency_s, 1e-9)

    @property
    def all_gather_bytes_per_s(self) -> float:
        return self.all_gather_bytes / max(self.all_gather_s - self.latency_s, 1e-9)

    @property
    def bytes_per_s(self) -> float:
        """Both collectives together: their bytes over their time, less the fixed cost of each."""
        seconds = self.all_reduce_s + self.all_gather_s - 2 * self.latency_s
        return (self.all_reduce_bytes + self.all_gather_bytes) / max(seconds, 1e-9)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the body on one intra-op thread, as every rank of the real runs does, then restore the setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def calibrate_device(work: Workload, repeats: int = 5, copy_mib: int = 64) -> DeviceCalibration:
    """Time ``work``'s forward + backward, its unsharded optimizer step and one large copy, on one thread."""
    with one_thread():
        torch.manual_seed(0)
        model, batch = work.build(), work.batch()
        optimizer = work.optimizer(model.parameters(), **dict(work.optimizer_options))

        def forward_backward() -> None:
            work.loss(call_model(model, batch), batch).backward()

        with FlopCounterMode(display=False) as counter:
            forward_backward()
        optimizer.step()  # creates the optimizer state, so the timed steps touch all of it
        compute_s = _median_seconds(forward_backward, repeats)
        optimizer_s = _median_seconds(optimizer.step, repeats)
        optimizer_bytes = 2 * training_memory(model, optimizer).total
        source = torch.ones(copy_mib * 2**18)
        target = torch.empty_like(source)
        copy_s = _median_seconds(lambda: target.copy_(source), repeats)
    return DeviceCalibration(
        float(counter.get_total_flops()), compute_s, optimizer_bytes, optimizer_s, source.nbytes, copy_s
    )


def _timed_collective(run: Callable[[], object], repeats: int) -> list[float]:
    """This rank's seconds of each repeat, every repeat started together after a barrier."""
    run()  # the first call sets up gloo's buffers
    times = []
    for _ in range(repeats):
        collectives.barrier(label="plan_time.calibrate")
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def _link_worker(rank: int, world_size: int, numel: int, repeats: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    tiny, big = torch.zeros(1), torch.zeros(numel)
    tiny_gathered = torch.zeros(world_size)
    shard = torch.zeros(numel // world_size)
    gathered = torch.zeros(shard.numel() * world_size)
    return {
        "latency": _timed_collective(lambda: collectives.all_reduce(tiny, label="plan_time.tiny"), 4 * repeats),
        "gather_latency": _timed_collective(
            lambda: collectives.all_gather_into_tensor(tiny_gathered, tiny, label="plan_time.tiny", by_sends=True),
            4 * repeats,
        ),
        "all_reduce": _timed_collective(lambda: collectives.all_reduce(big, label="plan_time.big"), repeats),
        "all_gather": _timed_collective(
            lambda: collectives.all_gather_into_tensor(gathered, shard, label="plan_time.big", by_sends=True), repeats
        ),
    }


def _slowest_median(per_rank: Sequence[Mapping[str, list[float]]], key: str) -> float:
    """Median over repeats of the slowest rank's time: a collective is done when its last rank is."""
    return median(max(times) for times in zip(*(ranks[key] for ranks in per_rank)))


def calibrate_link(world_size: int, mib: int = 16, repeats: int = 5) -> LinkCalibration:
    """Time a one-element all-reduce (latency) and a ``mib`` MiB all-reduce and all-gather (bandwidth) on gloo."""
    numel = mib * 2**18 // world_size * world_size
    per_rank = run_distributed(_link_worker, world_size, numel, repeats)
    share = (world_size - 1) / world_size
    payload = numel * 4
    return LinkCalibration(
        world_size,
        _slowest_median(per_rank, "latency"),
        _slowest_median(per_rank, "gather_latency"),
        int(2 * share * payload),
        _slowest_median(per_rank, "all_reduce"),
        int(share * payload),
        _slowest_median(per_rank, "all_gather"),
    )


@dataclass(frozen=True)
class StepTimes:
    """Seconds of each timed step on one rank: the whole step and its phases (forward includes the loss)."""

    step: list[float]
    forward: list[float]
    backward: list[float]
    optimizer: list[float]


def _step(work: Workload, built: Built, batch: Any, out: Optional[StepTimes]) -> None:
    """One training step started after a barrier; its times go to ``out`` unless it is a warm-up step."""
    model, optimizer, after_step = built
    collectives.barrier(label="plan_time.step")
    start = time.perf_counter()
    loss = work.loss(call_model(model, batch), batch)
    forward_end = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    optimizer.step()
    after_step()
    optimizer.zero_grad()
    end = time.perf_counter()
    if out is not None:
        out.step.append(end - start)
        out.forward.append(forward_end - start)
        out.backward.append(backward_end - forward_end)
        out.optimizer.append(end - backward_end)


def _steps_worker(
    rank: int, world_size: int, work: Workload, variants: list[Variant], warmup: int, steps: int
) -> dict[str, StepTimes]:
    """Every variant built side by side, warmed up, then timed in rounds of one step each.

    Interleaving the variants step by step spreads whatever else the machine does over all of them alike, so their
    ratios hold even when the absolute times drift.
    """
    torch.set_num_threads(1)
    batch = work.batch()
    built = {}
    for variant in variants:
        torch.manual_seed(0)
        spec = OptimizerSpec(work.optimizer, dict(work.optimizer_options))
        built[variant.label] = get(variant.strategy).build(work.build(), spec, options=dict(variant.options))
        for _ in range(warmup):
            _step(work, built[variant.label], batch, None)
    out = {variant.label: StepTimes([], [], [], []) for variant in variants}
    for _ in range(steps):
        for variant in variants:
            _step(work, built[variant.label], batch, out[variant.label])
    collectives.barrier(label="plan_time.done")
    return out


@dataclass(frozen=True)
class Measured:
    """Median seconds over the timed steps of the slowest rank in each step, whole and per phase."""

    step_s: float
    phase_s: Mapping[str, float]
    #: Interquartile range of the step times over their median: differences below it are noise.
    spread: float


def _slowest(per_rank: Sequence[StepTimes], phase: str) -> list[float]:
    return [max(times) for times in zip(*(getattr(ranks, phase) for ranks in per_rank))]


def _spread(times: list[float]) -> float:
    if len(times) < 2:
        return 0.0
    low, _, high = quantiles(times, n=4)
    return (high - low) / median(times)


def time_steps(
    work: Workload, variants: Sequence[Variant], world_size: int, warmup: int, steps: int
) -> dict[str, Measured]:
    """Train the variants side by side on ``world_size`` gloo processes: ``warmup`` steps each, then ``steps`` rounds
    of one timed step each."""
    per_rank = run_distributed(_steps_worker, world_size, work, list(variants), warmup, steps)
    out = {}
    for variant in variants:
        ranks = [result[variant.label] for result in per_rank]
        phases = {name: median(_slowest(ranks, name)) for name in ("forward", "backward", "optimizer")}
        step_times = _slowest(ranks, "step")
        out[variant.label] = Measured(median(step_times), phases, _spread(step_times))
    return out


__all__ = [
    "DeviceCalibration",
    "LinkCalibration",
    "Measured",
    "StepTimes",
    "Variant",
    "calibrate_device",
    "calibrate_link",
    "one_thread",
    "time_steps",
]
