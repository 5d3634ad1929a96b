"""Benchmark suite "tp": shardkit's tensor parallelism against torch's, and TP x FSDP against FSDP alone.

One run at world size 4 (``shardkit.launch.launch_local``, gloo), on :func:`shardkit.models.tp_lm.tp_lm` (GPT-style
blocks: separate ``q``/``k``/``v``/``o`` projections and a GELU feed-forward):

1. *TP*: the model split by shardkit's :class:`~shardkit.tensor_parallel.ColumnParallelLinear` /
   :class:`~shardkit.tensor_parallel.RowParallelLinear`, and the same ``nn.Linear`` model split by torch's
   ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``, at degree ``--tensor`` (2), from the same
   weights on the same batch. Reported: median step time (slowest rank), bytes one rank sends per step against
   the formula (:func:`~shardkit.models.tp_lm.tp_comm_bytes`: two all-reduces of ``batch x seq x dim`` per block
   forward, one per column layer backward), peak tensor memory per rank, and the split layers' parameters per
   rank against the unsplit model's.
2. *2-D*: FSDP over all ranks against shardkit TP with FSDP over the data-parallel ranks, at the same global batch.

Targets (issue 33): shardkit's TP step <= 1.0x torch's; bytes sent equal to the formula; parameters per rank 1/t of
the split layers. Run it as ``shardkit bench tp`` (options ``--world-size``, ``--tensor``, ``--steps``,
``--warmup``, ``--quick``, ``--json PATH``) or ``python -m shardkit.bench.tp``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from typing import Any

from shardkit.bench.tp_measure import Measured, TPBenchSettings, worker
from shardkit.launch import launch_local
from shardkit.models.tp_lm import tp_comm_bytes
from shardkit.utils.report import format_table, ratio, write_json

QUICK = TPBenchSettings(dim=32, heads=4, layers=1, vocab=64, batch=2, seq=8, steps=2, warmup=1)


def combine(per_rank: list[dict[str, list[Measured]]]) -> dict[str, list[Measured]]:
    """Per variant: the slowest rank's step times, rank 0's bytes, the highest peak over ranks."""
    out: dict[str, list[Measured]] = {}
    for part, rows in per_rank[0].items():
        merged = []
        for i, first in enumerate(rows):
            ranks = [r[part][i] for r in per_rank]
            slowest = max(ranks, key=lambda m: m.median_s)
            merged.append(
                Measured(
                    first.name,
                    slowest.step_s,
                    first.wire_bytes,
                    max(m.peak_bytes for m in ranks),
                    first.split_params,
                    first.first_loss,
                )
            )
        out[part] = merged
    return out


def formula_bytes(s: TPBenchSettings) -> int:
    """Bytes one rank of the split model sends per step by the formula."""
    return sum(tp_comm_bytes(s.batch, s.seq, s.dim, s.layers, s.tensor).values())


def unsplit_params(s: TPBenchSettings) -> int:
    """Parameters of the split projections in the unsplit model."""
    return s.layers * (4 * s.dim * s.dim + 2 * 4 * s.dim * s.dim)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def tables(results: dict[str, list[Measured]], s: TPBenchSettings, world_size: int) -> list[str]:
    """The two comparisons as Markdown tables."""
    formula, unsplit = formula_bytes(s), unsplit_params(s)
    torch_tp = results["tp"][-1]
    rows = [
        [
            m.name,
            f"{m.median_s * 1e3:.1f}",
            ratio(m.median_s, torch_tp.median_s),
            _mib(m.wire_bytes),
            _mib(formula),
            "yes" if m.wire_bytes == formula else "NO",
            _mib(m.peak_bytes),
            f"{m.split_params} ({m.split_params / unsplit:.3f})",
            f"{m.first_loss:.5f}",
        ]
        for m in results["tp"]
    ]
    headers = ["variant", "ms/step", "vs torch TP", "MiB sent/step", "formula MiB", "= formula"]
    headers += ["peak MiB/rank", "split-layer params/rank (of unsplit)", "first loss"]
    fsdp = results["2d"][0]
    two_d = [
        [m.name, f"{m.median_s * 1e3:.1f}", ratio(m.median_s, fsdp.median_s), _mib(m.wire_bytes), _mib(m.peak_bytes)]
        for m in results["2d"]
    ]
    return [
        f"TP {s.tensor} (world {world_size}: {world_size // s.tensor} TP groups side by side)",
        "",
        format_table(headers, rows),
        "",
        f"2-D at world {world_size}, global batch {s.batch * world_size // s.tensor} sequences",
        "",
        format_table(["variant", "ms/step", "vs FSDP", "MiB sent/step", "peak MiB/rank"], two_d),
    ]


def report(results: dict[str, list[Measured]], s: TPBenchSettings, world_size: int) -> str:
    """The suite's tables, notes and verdict on the targets."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    header = (
        f"tp suite: tp_lm {s.layers} blocks x width {s.dim}, {s.heads} heads, vocab {s.vocab}, seq {s.seq}, batch "
        f"{s.batch} per TP group; AdamW; {s.steps} timed steps after {s.warmup} warm-up, variants interleaved; gloo, "
        f"CPU, 1 thread per rank; load average {load:.2f} at the end"
    )
    notes = (
        "ms/step: median over the timed steps of the slowest rank. MiB sent/step: one rank's bytes in one step "
        "(shardkit's comm meter; torch's functional collectives counted by a dispatch mode), ring model. peak: "
        "tensor bytes alive at the step's peak (MemoryTracker), highest rank. first loss: the first step's loss "
        "(the same weights and batch: equal up to summation order)."
    )
    return "\n".join([header, "", *tables(results, s, world_size), "", notes, *verdict(results, s)])


def verdict(results: dict[str, list[Measured]], s: TPBenchSettings) -> list[str]:
    """One line per target: met or NOT met, with the measured figure."""
    ours, theirs = results["tp"][0], results["tp"][-1]
    speed = ours.median_s / theirs.median_s
    share = ours.split_params / unsplit_params(s)

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return [
        "",
        f"targets: shardkit TP step {speed:.2f}x torch's (<= 1.0: {met(speed <= 1.0)}); bytes sent "
        f"{ours.wire_bytes} = formula {formula_bytes(s)} ({met(ours.wire_bytes == formula_bytes(s))}; torch TP "
        f"{theirs.wire_bytes}); split-layer parameters per rank {share:.3f} of the unsplit (1/{s.tensor}: "
        f"{met(abs(share - 1 / s.tensor) < 1e-12)})",
    ]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of the suite (also accepted through ``shardkit bench tp ...``)."""
    parser = argparse.ArgumentParser(prog="shardkit bench tp", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--tensor", type=int, default=2, help="tensor-parallel degree (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2)")
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps (seconds), for tests")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args, _unknown = parser.parse_known_args(argv)
    return args


def settings_from_args(args: argparse.Namespace) -> TPBenchSettings:
    """Suite settings for parsed options (raises SystemExit on bad values)."""
    s = QUICK if args.quick else TPBenchSettings()
    if args.tensor < 2 or args.world_size % args.tensor:
        raise SystemExit(f"--tensor must be at least 2 and divide --world-size ({args.world_size}), got {args.tensor}")
    s = replace(s, tensor=args.tensor)
    if args.steps is not None:
        if args.steps < 1:
            raise SystemExit(f"--steps must be at least 1, got {args.steps}")
        s = replace(s, steps=args.steps)
    if args.warmup is not None:
        s = replace(s, warmup=max(1, args.warmup))
    return s


def run(argv: list[str]) -> None:
    """Run the suite with command-line options ``argv`` and print its tables."""
    args = parse_args(argv)
    s = settings_from_args(args)
    start = time.perf_counter()
    results = combine(launch_local(worker, args.world_size, s))
    print(report(results, s, args.world_size), flush=True)
    print(f"\n(suite wall time {time.perf_counter() - start:.0f} s)", flush=True)
    if args.json:
        payload: dict[str, Any] = {"settings": s, "formula_bytes": formula_bytes(s), "results": results}
        write_json(args.json, payload)


if __name__ == "__main__":
    run(sys.argv[1:])
