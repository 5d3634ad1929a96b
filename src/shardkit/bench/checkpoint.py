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
on a quiet machine. The per-rank measurements are in :mod:`shardkit.bench.checkpoint_measure`; this module prints
their tables and holds the command line.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from shardkit.bench.checkpoint_measure import (
    EXPORT_SHARD_BYTES,
    STRATEGIES,
    CheckpointBenchSettings,
    RankResult,
    worker,
)
from shardkit.launch import launch_local
from shardkit.memory.meter import format_bytes
from shardkit.utils.report import format_table, ratio, write_json

#: What a save or load may stage beyond what the rank holds anyway: the bound its memory rise is held to.
SLACK_BYTES = 256 * 1024**2


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
        per_rank = launch_local(worker, args.world_size, s, str(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(per_rank, s, args.world_size), flush=True)
    print(f"\n(suite wall time {time.perf_counter() - start:.0f} s)", flush=True)
    if args.json:
        write_json(args.json, {"settings": s, "ranks": per_rank})


__all__ = [
    "EXPORT_SHARD_BYTES",
    "SLACK_BYTES",
    "STRATEGIES",
    "CheckpointBenchSettings",
    "RankResult",
    "parse_args",
    "report",
    "run",
    "settings_from_args",
    "worker",
]


if __name__ == "__main__":
    run(sys.argv[1:])
