"""Benchmark suite "multinode": 2 nodes x 2 processes, what crosses the slow link between nodes, and what it costs.

Every strategy trains the bench LM with the same batches at world size 4 laid out as two nodes of two processes
(two torch elastic agents on 127.0.0.1 through :func:`shardkit.testing.multinode.run_nodes`, each a
``torchrun --nnodes 2 --nproc-per-node 2`` node). Per strategy:

1. *fast link*: a few steps counting the bytes each rank sends inside its node and to the other node (the comm
   meter's split, :mod:`shardkit.distributed.node_traffic`), and the step time;
2. *slow link*: the same steps with the inter-node link slowed (``comm_delay(latency, bandwidth,
   scope="inter_node")``, default 5 ms per collective and 100 MB/s); links inside a node stay fast.

Strategies: torch DDP (its bucket all-reduce routed through shardkit's collectives by a comm hook, so the meter
and the slow link see it), FSDP full sharding over the world, FSDP hybrid sharding (shard inside the node,
all-reduce gradient shards across nodes), OSS + ShardedDataParallel over the world and hybrid, and SlowMo
(``nprocs_per_node=2``: every step averages inside the node, every third step across nodes).

Run it as ``shardkit bench multinode`` (options: ``--steps``, ``--warmup``, ``--strategies``, ``--latency-ms``,
``--bandwidth-mbs``, ``--quick``, ``--json PATH``) or ``python -m shardkit.bench.multinode``. The workers that
build and train the strategies are in :mod:`shardkit.bench.multinode_measure`; this module merges what they
measured into the table and holds the command line.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from statistics import median
from typing import Optional

from shardkit.bench.multinode_measure import (
    FAILED_ELSEWHERE,
    STRATEGIES,
    MultinodeSettings,
    NodeResult,
    build,
    launch,
    worker,
)
from shardkit.bench.zero import QUICK_LM, load_text
from shardkit.strategies.live import paired_ratio
from shardkit.utils.report import format_table, write_json


@dataclass(frozen=True)
class Row:
    """One strategy merged over ranks: the rank sending most, per step the slowest rank, median over steps."""

    name: str
    inter_node_bytes: int
    intra_node_bytes: int
    fast_step_s: float
    slow_step_s: float
    #: Per timed slow-link step, the slowest rank's seconds (for ratios paired step by step).
    slow_steps: list[float]
    final_loss: float
    error: Optional[str]


def merge(per_rank: list[list[NodeResult]]) -> list[Row]:
    """One :class:`Row` per strategy."""
    rows = []
    for same in zip(*per_rank):
        error = next((r.error for r in same if r.error and r.error != FAILED_ELSEWHERE), None)
        error = error or next((r.error for r in same if r.error), None)

        def per_step(series: list[list[float]]) -> list[float]:
            return [max(ts) for ts in zip(*series)]

        def slowest(series: list[list[float]]) -> float:
            steps = per_step(series)
            return median(steps) if steps else float("nan")

        losses = [sum(ls) / len(ls) for ls in zip(*(r.losses for r in same))]
        rows.append(
            Row(
                name=same[0].name,
                inter_node_bytes=max(r.inter_node_bytes for r in same),
                intra_node_bytes=max(r.intra_node_bytes for r in same),
                fast_step_s=slowest([r.fast_step_s for r in same]),
                slow_step_s=slowest([r.slow_step_s for r in same]),
                slow_steps=per_step([r.slow_step_s for r in same]),
                final_loss=losses[-1] if losses else float("nan"),
                error=error,
            )
        )
    return rows


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def targets(rows: list[Row]) -> list[str]:
    """The suite's two targets (hybrid vs full FSDP), measured."""
    by_name = {r.name: r for r in rows if r.error is None}
    full, hybrid = by_name.get("fsdp"), by_name.get("fsdp_hybrid")
    if full is None or hybrid is None or not full.inter_node_bytes or not full.slow_step_s:
        return []
    bytes_ratio = hybrid.inter_node_bytes / full.inter_node_bytes
    time_ratio = paired_ratio(hybrid.slow_steps, full.slow_steps)

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return [
        f"targets (fsdp_hybrid vs fsdp): inter-node bytes {bytes_ratio:.2f}x (<= 0.5x: {verdict(bytes_ratio <= 0.5)}), "
        f"step on the slow link {time_ratio:.2f}x (<= 0.7x: {verdict(time_ratio <= 0.7)})"
    ]


def report(rows: list[Row], settings: MultinodeSettings, how: str, load: str = "") -> str:
    """The printed output: settings, the table, notes, failures and the targets."""
    lm = settings.lm
    base = next((r for r in rows if r.name == "fsdp" and r.error is None), None)
    table = [
        [
            r.name,
            _mb(r.inter_node_bytes),
            _mb(r.intra_node_bytes),
            f"{r.fast_step_s * 1000:.0f}",
            f"{r.slow_step_s * 1000:.0f}",
            f"{paired_ratio(r.slow_steps, base.slow_steps):.2f}x" if base else "-",
            f"{r.final_loss:.4f}",
        ]
        for r in rows
        if r.error is None
    ]
    headers = [
        "strategy",
        "inter-node MB/step",
        "intra-node MB/step",
        "step ms",
        "step ms slow link",
        "vs fsdp",
        "loss",
    ]
    lines = [
        f"multinode suite: TransformerLM {lm.n_layers} blocks x width {lm.d_model}, vocab {lm.vocab_size}, seq "
        f"{lm.seq_len}; batch {settings.batch_size}/rank; AdamW; {settings.nnodes} nodes x "
        f"{settings.nproc_per_node} processes ({how}); gloo; strategies interleaved step by step, "
        f"{settings.steps} timed steps per link after {settings.warmup} warm-up; slow link: "
        f"{settings.latency_s * 1000:g} ms + "
        f"{settings.bandwidth_bytes_per_s / 1e6:g} MB/s between nodes",
        load,
        "",
        format_table(headers, table),
        "",
        "MB/step: bytes one rank sends per step (the rank sending most), split by the comm meter's node model.",
        "step ms: per step the slowest rank, median over timed steps; 'slow link' slows only collectives that",
        "  cross nodes (comm_delay scope='inter_node'), by their inter-node bytes. vs fsdp: median over slow-link",
        "  steps of the ratio to fsdp's time in the same step (strategies run interleaved).",
        *(f"  {name}: {text}" for name, text in STRATEGIES.items() if name in settings.strategies),
    ]
    failed = [f"  {r.name}: FAILED ({r.error})" for r in rows if r.error is not None]
    if failed:
        lines += ["", "not run:", *failed]
    lines += ["", *targets(rows)]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of the suite (also accepted through ``shardkit bench multinode ...``)."""
    parser = argparse.ArgumentParser(prog="shardkit bench multinode", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per link (default 4)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2)")
    parser.add_argument("--strategies", default=None, help=f"comma-separated subset of {','.join(STRATEGIES)}")
    parser.add_argument("--latency-ms", type=float, default=5.0, help="inter-node latency per collective (5)")
    parser.add_argument("--bandwidth-mbs", type=float, default=100.0, help="inter-node bandwidth, MB/s (100)")
    parser.add_argument("--world-size", type=int, default=None, help="ignored: the suite runs 2 nodes x 2")
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps, for tests")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def run(argv: list[str]) -> None:
    """Entry point of the suite: parse ``argv``, train every strategy on both links, print the table."""
    args = parse_args(argv)
    settings = MultinodeSettings()
    try:
        if args.strategies:
            settings = replace(settings, strategies=tuple(args.strategies.split(",")))
        if args.quick:
            settings = replace(settings, lm=QUICK_LM, steps=2, warmup=1, timeout_s=240.0)
        if args.steps is not None:
            settings = replace(settings, steps=args.steps)
        if args.warmup is not None:
            settings = replace(settings, warmup=args.warmup)
        settings = replace(settings, latency_s=args.latency_ms / 1000, bandwidth_bytes_per_s=args.bandwidth_mbs * 1e6)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    load = load_text("start")
    per_rank, how = launch(settings)
    load += f"; {load_text('end')}"
    rows = merge(per_rank)
    print(report(rows, settings, how, load), flush=True)
    if args.json:
        write_json(args.json, {"settings": settings, "rows": rows})


__all__ = [
    "STRATEGIES",
    "MultinodeSettings",
    "NodeResult",
    "Row",
    "build",
    "launch",
    "merge",
    "parse_args",
    "report",
    "run",
    "targets",
    "worker",
]


if __name__ == "__main__":
    # Through the package module, so nothing the agents unpickle is defined in __main__.
    from shardkit.bench.multinode import run as _run_suite

    _run_suite(sys.argv[1:])
