"""``shardkit bench plan-time``: how well ``shardkit plan``'s predicted step time ranks and sizes real steps.

1. **Calibrate** the cost model (:mod:`shardkit.plan.cost`) on this machine, one constant per measurement, on one
   thread as each rank gets: ``flops_per_s`` from one forward + backward of each workload, ``memory_bytes_per_s``
   from its unsharded optimizer step, the host link from one large copy, and ``LinkSpec`` from gloo collectives at
   each world size (see :mod:`shardkit.bench.plan_time_measure`).
2. **Predict** each strategy's step with those constants (``estimate(..., backend="gloo")``: a CPU plan, where
   compute and communication take turns), and that again with the compute slowed by the ranks sharing each core
   when the world outnumbers the cores ("cores shared": the calibration had a core to itself, and the planner
   does not know how many cores a rank gets).
3. **Measure** the same workload and strategy on real gloo processes: warm-up steps, then the median over timed
   steps of the slowest rank, each step started after a barrier.
4. **Compare**: predicted / measured per row, whether the predicted ranking of the strategies is the measured one
   (and Kendall's tau), each strategy's time relative to DDP, and the phases side by side.

Options: ``--quick`` (demo LM, world size 2, few steps; seconds), ``--world-size N``, ``--steps N``, ``--warmup N``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from shardkit.bench.plan_time_measure import (
    DeviceCalibration,
    LinkCalibration,
    Measured,
    Variant,
    calibrate_device,
    calibrate_link,
    time_steps,
)
from shardkit.plan import Estimate, estimate
from shardkit.plan.cost import DeviceSpec, LinkSpec
from shardkit.plan.workloads import Workload

VARIANTS = [
    Variant("ddp", "ddp"),
    Variant("oss_ddp", "oss_ddp"),
    Variant("oss_sdp", "oss_sdp"),
    Variant("fsdp", "fsdp"),
    Variant("fsdp + cpu offload", "fsdp", {"cpu_offload": True}),
]
#: A rate no measurement reaches: the model with this constant leaves that resource out.
UNLIMITED = 1e30


@dataclass(frozen=True)
class Row:
    """One workload, world size and strategy: predicted and measured seconds."""

    workload: str
    world_size: int
    strategy: str
    predicted_s: float
    #: The model's step with communication free, and with compute free (their sum is the CPU plan's step).
    compute_only_s: float
    comm_only_s: float
    predicted_phase_s: dict[str, float]
    measured: Measured
    #: Ranks per core (the calibration ran with a core to itself): more than 1 when the world outnumbers the cores.
    ranks_per_core: float = 1.0

    @property
    def ratio(self) -> float:
        return self.predicted_s / self.measured.step_s

    @property
    def shared_serial_s(self) -> float:
        """The serial step with compute slowed by the ranks sharing each core (not something the planner knows)."""
        return self.compute_only_s * max(1.0, self.ranks_per_core) + self.comm_only_s


def device_spec(cal: DeviceCalibration) -> DeviceSpec:
    """The calibrated device: the CPU optimizer step of an offloaded run uses the same memory."""
    return DeviceSpec(
        flops_per_s=cal.flops_per_s,
        memory_bytes_per_s=cal.memory_bytes_per_s,
        host_link_bytes_per_s=cal.copy_bytes_per_s,
        host_memory_bytes_per_s=cal.memory_bytes_per_s,
    )


def link_spec(cal: LinkCalibration) -> LinkSpec:
    """The calibrated link: every rank on one host, so no node layout and one bandwidth."""
    return LinkSpec(bytes_per_s=cal.bytes_per_s, intra_bytes_per_s=cal.bytes_per_s, latency_s=cal.latency_s)


def _estimate(work: Workload, variant: Variant, world_size: int, device: DeviceSpec, link: LinkSpec) -> Estimate:
    return estimate(
        work.build, work.batch(), loss_fn=work.loss, strategy=variant.strategy, world_size=world_size,
        optimizer=work.optimizer, optimizer_options=work.optimizer_options, strategy_options=variant.options,
        device=device, link=link, backend="gloo",
    )  # fmt: skip


def predict_row(
    work: Workload, variant: Variant, world_size: int, device: DeviceSpec, link: LinkSpec
) -> tuple[float, float, float, dict[str, float]]:
    """Predicted step, compute-only step, communication-only step and predicted phases of one strategy."""
    est = _estimate(work, variant, world_size, device, link)
    free_link = LinkSpec(bytes_per_s=UNLIMITED, intra_bytes_per_s=UNLIMITED, latency_s=0.0)
    compute_device = DeviceSpec(
        flops_per_s=device.flops_per_s, memory_bytes_per_s=device.memory_bytes_per_s,
        host_link_bytes_per_s=UNLIMITED, host_memory_bytes_per_s=device.host_memory_bytes_per_s,
    )  # fmt: skip
    comm_device = DeviceSpec(
        flops_per_s=UNLIMITED, memory_bytes_per_s=UNLIMITED, host_link_bytes_per_s=device.host_link_bytes_per_s,
        host_memory_bytes_per_s=UNLIMITED,
    )  # fmt: skip
    compute_only = _estimate(work, variant, world_size, compute_device, free_link).step_seconds
    comm_only = _estimate(work, variant, world_size, comm_device, link).step_seconds
    return est.step_seconds, compute_only, comm_only, dict(est.phase_seconds)


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-a of two orderings of the same items: +1 same order, -1 reversed."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    if not pairs:
        return 1.0
    agree = sum(math.copysign(1, a[i] - a[j]) * math.copysign(1, b[i] - b[j]) for i, j in pairs)
    return agree / len(pairs)


def _workloads(quick: bool) -> list[tuple[str, Workload, int]]:
    """Label, workload and timed steps (the demo LM's steps are short, so more of them)."""
    if quick:
        return [("demo LM", Workload.demo_lm(batch_size=2), 2)]
    return [
        ("bench LM (4 blocks)", Workload.bench_lm(batch_size=2, overrides={"n_layers": 4}), 7),
        ("demo LM", Workload.demo_lm(batch_size=8), 30),
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A markdown table under a title line."""
    print(f"\n{title}\n| {' | '.join(header)} |\n|{'---|' * len(header)}")
    for row in rows:
        print(f"| {' | '.join(str(cell) for cell in row)} |")


def print_constants(devices: dict[str, DeviceCalibration], links: dict[int, LinkCalibration]) -> None:
    """The calibrated constants, with the measurements they came from."""
    _table(
        "Device (one thread):",
        ["workload", "GFLOP / fwd+bwd", "ms", "flops_per_s GFLOP/s", "memory_bytes_per_s GB/s", "host copy GB/s"],
        [
            [
                label,
                f"{d.flops / 1e9:.2f}",
                _ms(d.compute_s),
                f"{d.flops_per_s / 1e9:.1f}",
                f"{d.memory_bytes_per_s / 1e9:.2f}",
                f"{d.copy_bytes_per_s / 1e9:.2f}",
            ]
            for label, d in devices.items()
        ],
    )
    _table(
        "Link (gloo, loopback; bytes each rank sends):",
        ["world", "latency_s us", "all_reduce GB/s", "all_gather GB/s", "bytes_per_s GB/s", "all_gather latency us"],
        [
            [
                world,
                f"{c.latency_s * 1e6:.0f}",
                f"{c.all_reduce_bytes_per_s / 1e9:.2f}",
                f"{c.all_gather_bytes_per_s / 1e9:.2f}",
                f"{c.bytes_per_s / 1e9:.2f}",
                f"{c.gather_latency_s * 1e6:.0f}",
            ]
            for world, c in links.items()
        ],
    )


def _ranking(group: Sequence[Row], key: Callable[[Row], float]) -> list[str]:
    return [r.strategy for r in sorted(group, key=key)]


def print_rows(rows: Sequence[Row]) -> None:
    """The main table, the phases, the rankings and the times relative to DDP."""
    _table(
        "Step time:",
        [
            "workload",
            "world",
            "strategy",
            "predicted ms",
            "measured ms",
            "ratio",
            "cores shared: ratio",
            "step spread",
        ],
        [
            [
                r.workload,
                r.world_size,
                r.strategy,
                _ms(r.predicted_s),
                _ms(r.measured.step_s),
                f"{r.ratio:.2f}",
                f"{r.shared_serial_s / r.measured.step_s:.2f}",
                f"{r.measured.spread:.0%}",
            ]
            for r in rows
        ],
    )
    phases = ("forward", "backward", "optimizer")
    _table(
        "Phases, predicted / measured ms:",
        ["workload", "world", "strategy", *phases],
        [
            [
                r.workload,
                r.world_size,
                r.strategy,
                *(f"{_ms(r.predicted_phase_s[p])} / {_ms(r.measured.phase_s[p])}" for p in phases),
            ]
            for r in rows
        ],
    )
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.workload, r.world_size), []).append(r)
    ranking_rows = []
    for (workload, world), group in groups.items():
        measured = [r.measured.step_s for r in group]
        by_measured = _ranking(group, lambda r: r.measured.step_s)
        by_predicted = _ranking(group, lambda r: r.predicted_s)
        tau = kendall_tau([r.predicted_s for r in group], measured)
        ranking_rows.append(
            [
                workload,
                world,
                ", ".join(by_predicted),
                ", ".join(by_measured),
                "yes" if by_predicted == by_measured else "no",
                f"{tau:+.2f}",
            ]
        )
    _table(
        "Ranking, fastest first:",
        ["workload", "world", "predicted", "measured", "same", "Kendall tau"],
        ranking_rows,
    )
    relative_rows = []
    for (workload, world), group in groups.items():
        ddp = next((r for r in group if r.strategy == "ddp"), None)
        if ddp is not None:
            relative_rows += [
                [
                    workload,
                    world,
                    r.strategy,
                    f"{r.predicted_s / ddp.predicted_s:.2f}",
                    f"{r.measured.step_s / ddp.measured.step_s:.2f}",
                ]
                for r in group
            ]
    _table("Relative to ddp, predicted / measured:", ["workload", "world", "strategy", "predicted", "measured"],
           relative_rows)  # fmt: skip
    high, low = max(rows, key=lambda r: r.ratio), min(rows, key=lambda r: r.ratio)
    print(f"\nlargest ratio {high.ratio:.2f} ({high.workload}, world {high.world_size}, {high.strategy}); "
          f"smallest ratio {low.ratio:.2f} ({low.workload}, world {low.world_size}, {low.strategy})")  # fmt: skip


def run(argv: list[str]) -> None:
    """Calibrate, predict, measure and print the tables (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="shardkit bench plan-time", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="demo LM, world size 2, few steps")
    parser.add_argument("--world-size", type=int, default=None, help="only this world size")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per strategy")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2, quick 1)")
    args = parser.parse_args(argv)
    sizes = [args.world_size] if args.world_size else ([2] if args.quick else [2, 4])
    if any(size < 2 for size in sizes):
        parser.error("--world-size must be at least 2: a step time against one process measures no communication")
    if (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0):
        parser.error("--steps must be at least 1 and --warmup at least 0")
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    workloads = _workloads(args.quick)
    print(_machine_state("start"))
    devices = {label: calibrate_device(work, repeats=3 if args.quick else 9) for label, work, _ in workloads}
    links = {size: calibrate_link(size, mib=1 if args.quick else 16, repeats=3 if args.quick else 11) for size in sizes}
    print_constants(devices, links)
    rows = []
    for label, work, default_steps in workloads:
        for size in sizes:
            measured = time_steps(work, VARIANTS, size, warmup, args.steps or default_steps)
            for variant in VARIANTS:
                device, link = device_spec(devices[label]), link_spec(links[size])
                predicted, compute, comm, phases = predict_row(work, variant, size, device, link)
                rows.append(
                    Row(label, size, variant.label, predicted, compute, comm, phases, measured[variant.label],
                        size / _cores())
                )  # fmt: skip
    print_rows(rows)
    print(_machine_state("end"))


def _cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _machine_state(when: str) -> str:
    """Cores and the load average: a step time means little without them."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"machine at {when}: {_cores()} cores, load average {load} (every rank runs one thread)"


__all__ = ["VARIANTS", "Row", "device_spec", "kendall_tau", "link_spec", "predict_row", "run"]
