"""What the wrap-time value agreement of FSDP costs (issue 32, items 1 and 2), and what one save's directory check
costs (item 4). A program, not a test::

    cd tests/reliability && PYTHONPATH=../../src:. python measure_wrap_checks.py [layers] [width] [trials]

Two ranks over gloo. Each trial builds ``layers`` Linear(width, width) layers, wraps each in its own FSDP unit and
the whole in a root unit, and times the wrap with the ranks holding the same values (and, inside it, the time spent
computing checksums: the new cost, the all-gather being the one the wrap already made), and with every rank
seeded differently (the checksums differ and every tensor is broadcast from rank 0). Each rank prints medians.
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
from shardkit.distributed.objects import broadcast_object
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
    spent: list[float] = []

    def timed(tensors: list[torch.Tensor]) -> list[int]:
        start = time.perf_counter()
        sums = shipped(tensors)
        spent.append(time.perf_counter() - start)
        return sums

    start_values.value_checksums = timed  # type: ignore[assignment]
    times: dict[str, list[float]] = {"wrap, ranks agree": [], "of which checksums": [], "wrap, ranks differ": []}
    for _ in range(trials):
        spent.clear()
        times["wrap, ranks agree"].append(_wrap(layers, width, seed=0))
        times["of which checksums"].append(sum(spent))
        times["wrap, ranks differ"].append(_wrap(layers, width, seed=rank))
    start_values.value_checksums = shipped  # type: ignore[assignment]
    # The directory check is one small all-gather; it replaced the broadcast of the temporary directory's name,
    # which now travels in the preparation's existing all-gather. Both timed, interleaved.
    save: dict[str, list[float]] = {"directory check (new)": [], "name broadcast (removed)": []}
    for _ in range(trials * 20):
        dist.barrier()
        start = time.perf_counter()
        checkpoint_comm.check_same_target("save_checkpoint", Path("/tmp/ckpt/step_00000001"), 1)
        save["directory check (new)"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        broadcast_object("/tmp/.step_00000001.tmp-0123456789ab", 0, None, "checkpoint.save_checkpoint: directory")
        save["name broadcast (removed)"].append(time.perf_counter() - start)
    return {
        "wrap": {k: statistics.median(v) for k, v in times.items()},
        "save": {k: statistics.median(v) for k, v in save.items()},
    }


def main() -> None:
    given = [int(a) for a in sys.argv[1:4]]
    layers, width, trials = given + [8, 1024, 5][len(given) :]
    results = run_distributed(_job, 2, layers, width, trials, timeout_s=900)
    numel = layers * (width * width + width)
    print(f"{layers} x Linear({width}, {width}): {numel / 1e6:.1f} M parameters, {numel * 4 / 2**20:.0f} MiB float32")
    for rank, out in enumerate(results):
        wrap = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in out["wrap"].items())
        print(f"rank {rank}: medians of {trials}: {wrap}")
        save = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in out["save"].items())
        print(f"rank {rank}: save_checkpoint, medians of {trials * 20}: {save}")


if __name__ == "__main__":
    main()
