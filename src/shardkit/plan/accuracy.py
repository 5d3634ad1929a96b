"""Planned against measured: the planner's rank 0 beside a real gloo run's, for a workload and strategies.

Memory is compared with torch's ``MemTracker`` (peak) and the real tensors (state). Traffic is compared with
shardkit's comm meter in the real run, plus, for the strategies built on torch DDP, DDP's own gradient all-reduce
and its broadcast of the buffers before each forward (which the meter cannot see;
:func:`shardkit.distributed.comm_formulas.ddp_allreduce_bytes` and
:func:`~shardkit.distributed.comm_formulas.ddp_buffer_broadcast_bytes`, the volumes the benchmarks add for them).
The real run is on the CPU, where device and host memory are one memory, so the planned peak compared is that of
both together (:attr:`~shardkit.plan.api.Estimate.total_peak_bytes`; the device peak when nothing is offloaded) and
the planned state is the device's plus the host's. The real run is on gloo, so the planner plans a gloo run
(``backend="gloo"``): it takes the CPU paths the real ranks take (OSS's parameter sends from each owner,
ShardedDataParallel's reduce by sends at two ranks, FSDP's direct exchanges), with their receive buffers, and rank 0
sends what the real rank 0 sends.

Example::

    for row in compare(Workload.demo_lm(), ["ddp", "fsdp"], world_size=2):
        print(row.format())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardkit.distributed.comm_formulas import ddp_allreduce_bytes, ddp_buffer_broadcast_bytes
from shardkit.plan.api import estimate
from shardkit.plan.measure import measure_real
from shardkit.plan.strategies import PIPELINE
from shardkit.plan.workloads import Workload

#: Strategies whose gradients torch DDP reduces (invisible to the comm meter).
TORCH_DDP = ("ddp", "oss_ddp")


@dataclass(frozen=True)
class Row:
    """One strategy of one workload at one world size: predicted and measured."""

    workload: str
    strategy: str
    world_size: int
    planned_peak: int
    real_peak: int
    planned_state: int
    real_state: int
    planned_comm: int
    #: The real run's bytes sent per step by rank 0.
    real_comm: int
    plan_seconds: float
    #: Inter-node bytes sent per step, planned and real (rank 0), when the workload has a node layout.
    planned_inter: int = 0
    real_inter: int = 0

    @property
    def peak_error(self) -> float:
        return self.planned_peak / self.real_peak - 1

    @property
    def state_error(self) -> float:
        return self.planned_state / self.real_state - 1

    def format(self) -> str:
        mib = 2**20
        return (
            f"| {self.workload} | {self.strategy} | {self.world_size} | {self.planned_peak / mib:.1f} | "
            f"{self.real_peak / mib:.1f} | {self.peak_error:+.1%} | {self.planned_state / mib:.1f} | "
            f"{self.real_state / mib:.1f} | {self.state_error:+.1%} | {self.planned_comm} | {self.real_comm} | "
            f"{'yes' if self.planned_comm == self.real_comm else 'NO'} | {self.plan_seconds:.2f} |"
        )


HEADER = (
    "| model | strategy | world | planned peak MiB | real peak MiB | error | planned state MiB | real state MiB | "
    "error | planned bytes sent | real bytes sent | equal | plan s |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _real_comm(rank0: dict[str, int], torch_bytes: int) -> int:
    """Rank 0's bytes sent: the comm meter's count plus torch DDP's own all-reduce (``torch_bytes``)."""
    return sum(rank0.values()) + torch_bytes


def compare(work: Workload, strategies: Sequence[str], world_size: int, label: str = "") -> list[Row]:
    """Plan each strategy for rank 0 of ``world_size`` and measure it in a real gloo run; one row each."""
    import time

    if work.tensor_parallel > 1 and set(strategies) & set(TORCH_DDP):
        raise ValueError(
            f"compare() checks a tensor-parallel plan with shardkit's strategies only (not {TORCH_DDP}: torch DDP's "
            "bytes are counted here from the unsplit model)"
        )
    planned = {}
    seconds = {}
    for name in strategies:
        start = time.perf_counter()
        planned[name] = estimate(
            work.build, work.batch(), loss_fn=work.loss, strategy=name, world_size=world_size,
            optimizer=work.optimizer, optimizer_options=work.optimizer_options,
            strategy_options=work.strategy_options, nprocs_per_node=work.nprocs_per_node, backend="gloo",
            tensor_parallel=work.tensor_parallel,
        )  # fmt: skip
        seconds[name] = time.perf_counter() - start
    real = measure_real(work, strategies, world_size)
    ddp_bytes = 0
    if set(strategies) & set(TORCH_DDP):  # not with tensor parallelism (refused above): the model is unsplit
        with torch.device("meta"):
            model = work.build()
            ddp_bytes = ddp_allreduce_bytes(model, world_size)
            if work.strategy_options.get("broadcast_buffers", True):
                ddp_bytes += ddp_buffer_broadcast_bytes(model, world_size)
    rows = []
    for name in strategies:
        est, ranks = planned[name], real[name]
        torch_bytes = ddp_bytes if name in TORCH_DDP else 0
        if name == PIPELINE:  # the planner reports the pipeline stage with the highest peak: compare with that rank
            worst = max(range(len(ranks)), key=lambda r: ranks[r].peak_bytes)
            ranks = [ranks[worst]]
        rows.append(
            Row(
                label or work.kind,
                name,
                world_size,
                est.total_peak_bytes,  # a CPU run has one memory: with offload, the device's and the host's
                ranks[0].peak_bytes,
                est.state_bytes + est.host.state_bytes,
                ranks[0].state_bytes,
                sum(est.comm_bytes.values()),
                _real_comm(ranks[0].comm_wire_bytes, torch_bytes),
                seconds[name],
                sum(est.inter_node_bytes.values()),
                sum(ranks[0].inter_node_bytes.values()),
            )
        )
    return rows


__all__ = ["HEADER", "Row", "compare"]
