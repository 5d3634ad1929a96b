"""What the wrap-time value agreement of FSDP costs (issue 32, items 1 and 2), and what one save's directory check
costs (item 4). A program, not a test::

    cd tests/reliability && PYTHONPATH=../../src:. python measure_wrap_checks.py [layers] [width] [trials]

Two ranks over gloo. Each trial builds ``layers`` Linear(width, width) layers, wraps each in its own FSDP unit and
the whole in a root unit, and times the wrap: as shipped (checksums in the wrap's all-gather), with the checksums
replaced by constants (what the wrap cost before), and with every rank seeded differently (the checksums differ
and every tensor is broadcast from rank 0). The three kinds are interleaved; medians are printed by rank 0.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint import _collectives as checkpoint_comm
from shardkit.distributed.model_check import value_checksums
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import start_values
from shardkit.testing import run_distributed


def _wrap(layers: int, width: int, seed: int) -> float:
    torch.manual_seed(seed)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    dist.barrier()
    start = time.perf_counter()
    for i in range(layers):
        net[i] = FSDP(net[i])
    FSDP(net)
    return time.perf_counter() - start


def _job(rank: int, world_size: int, layers: int, width: int, trials: int) -> dict[str, Any]:
    shipped = start_values.value_checksums
    times: dict[str, list[float]] = {"with checksums": [], "without (constants)": [], "ranks differ": []}
    for _ in range(trials):
        times["with checksums"].append(_wrap(layers, width, seed=0))
        start_values.value_checksums = lambda tensors: [(0, 0)] * len(tensors)  # type: ignore[assignment]
        times["without (constants)"].append(_wrap(layers, width, seed=0))
        start_values.value_checksums = shipped  # type: ignore[assignment]
        times["ranks differ"].append(_wrap(layers, width, seed=rank))
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    start = time.perf_counter()
    for _ in range(trials):
        value_checksums(list(net.parameters()))
    checksum_s = (time.perf_counter() - start) / trials
    save_check = []
    for _ in range(trials * 20):
        dist.barrier()
        start = time.perf_counter()
        checkpoint_comm.check_same_target("save_checkpoint", Path("/tmp/ckpt/step_00000001"), 1)
        save_check.append(time.perf_counter() - start)
    return {
        "wrap": {k: statistics.median(v) for k, v in times.items()},
        "checksums alone": checksum_s,
        "save directory check": statistics.median(save_check),
    }


def main() -> None:
    given = [int(a) for a in sys.argv[1:4]]
    layers, width, trials = given + [8, 1024, 5][len(given) :]
    results = run_distributed(_job, 2, layers, width, trials, timeout_s=900)
    numel = layers * (width * width + width)
    print(f"{layers} x Linear({width}, {width}): {numel / 1e6:.1f} M parameters, {numel * 4 / 2**20:.0f} MiB float32")
    for rank, out in enumerate(results):
        wrap = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in out["wrap"].items())
        print(f"rank {rank}: wrap (median of {trials}): {wrap}")
        print(f"rank {rank}: checksums of the whole model alone: {out['checksums alone'] * 1e3:.1f} ms")
        print(f"rank {rank}: save_checkpoint's directory check: {out['save directory check'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
