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
``--bandwidth-mbs``, ``--quick``, ``--json PATH``) or ``python -m shardkit.bench.multinode``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.bench.ddp_hook import labelled_allreduce_hook
from shardkit.bench.report import format_table, write_json
from shardkit.bench.runner import paired_ratio
from shardkit.bench.zero import QUICK_LM, load_text
from shardkit.demo.task import MarkovTask
from shardkit.distributed import CommMeter, collectives, comm_delay, count_comm_bytes
from shardkit.distributed.node_traffic import set_topology
from shardkit.distributed.topology import Topology
from shardkit.testing.models import LMConfig, TransformerLM
from shardkit.utils.checks import at_least, positive

#: Every strategy of the suite, in table order.
STRATEGIES: dict[str, str] = {
    "ddp": "torch DDP + AdamW (all-reduce over the world)",
    "fsdp": "FSDP per block + root, FULL_SHARD over the world",
    "fsdp_hybrid": "FSDP per block + root, HYBRID_SHARD (shard in the node, all-reduce shards across nodes)",
    "oss_sdp": "OSS + ShardedDataParallel over the world",
    "oss_sdp_hybrid": "OSS + ShardedDataParallel sharded in the node, owners all-reduce across nodes",
    "slowmo": "SlowMo LocalSGD, nprocs_per_node=2 (node average every step, across nodes every 3rd)",
}


@dataclass(frozen=True)
class MultinodeSettings:
    """What the suite runs; plain data handed to every worker."""

    strategies: tuple[str, ...] = tuple(STRATEGIES)
    lm: LMConfig = field(default_factory=LMConfig.bench)
    #: Sequences per rank per step: one, so that on this machine's two cores the step is not all computation
    #: and the link's share of it shows.
    batch_size: int = 1
    #: Timed steps per link.
    steps: int = 4
    #: Untimed steps first (lazy initialisation, allocations).
    warmup: int = 2
    lr: float = 1e-3
    seed: int = 0
    nnodes: int = 2
    nproc_per_node: int = 2
    #: Simulated inter-node link: fixed cost per collective (seconds) and bandwidth (bytes per second).
    latency_s: float = 0.005
    bandwidth_bytes_per_s: float = 100e6
    #: A job running longer than this is killed (seconds).
    timeout_s: float = 1500.0

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown multinode strategies {unknown}; choose from {', '.join(STRATEGIES)}")
        for name in ("batch_size", "steps", "nnodes", "nproc_per_node"):
            at_least(self, name, getattr(self, name), 1)
        at_least(self, "warmup", self.warmup, 0)
        at_least(self, "latency_s", self.latency_s, 0.0)
        for name in ("lr", "bandwidth_bytes_per_s", "timeout_s"):
            positive(self, name, getattr(self, name))


@dataclass
class NodeResult:
    """One strategy on one rank: bytes per step by link, step times on the fast and the slow link, losses."""

    name: str
    inter_node_bytes: int = 0
    intra_node_bytes: int = 0
    fast_step_s: list[float] = field(default_factory=list)
    slow_step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    error: Optional[str] = None


Built = tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]


def _fsdp(model: nn.Module, process_group: Any, **kwargs: Any) -> nn.Module:
    from shardkit.nn import FullyShardedDataParallel
    from shardkit.nn.fsdp import BackwardPrefetch

    def wrap(module: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(
            module,
            process_group=process_group,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=True,
            **kwargs,
        )

    blocks = model.blocks
    assert isinstance(blocks, nn.ModuleList)
    for index, block in enumerate(blocks):
        blocks[index] = wrap(block)
    return wrap(model)


def build(name: str, model: nn.Module, group: dist.ProcessGroup, settings: MultinodeSettings) -> Built:
    """``(model, optimizer, after_step)`` for strategy ``name`` over ``group`` (the whole job)."""
    from shardkit.nn import ShardedDataParallel, ShardingStrategy, SlowMoDistributedDataParallel
    from shardkit.optim import OSS

    adamw = torch.optim.AdamW
    nothing: Callable[[], None] = lambda: None  # noqa: E731
    nodes = Topology.from_env(group, nprocs_per_node=settings.nproc_per_node)
    if name == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        ddp.register_comm_hook(group, labelled_allreduce_hook)
        return ddp, adamw(ddp.parameters(), lr=settings.lr), nothing
    if name in ("fsdp", "fsdp_hybrid"):
        hybrid = name == "fsdp_hybrid"
        strategy = ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.FULL_SHARD
        wrapped = _fsdp(model, nodes if hybrid else group, sharding_strategy=strategy)
        return wrapped, adamw(wrapped.parameters(), lr=settings.lr), nothing
    if name in ("oss_sdp", "oss_sdp_hybrid"):
        opt = OSS(model.parameters(), optim=adamw, group=nodes if name == "oss_sdp_hybrid" else group, lr=settings.lr)
        return ShardedDataParallel(model, opt), opt, nothing
    if name == "slowmo":
        net = SlowMoDistributedDataParallel(model, nprocs_per_node=settings.nproc_per_node, global_group=group)
        plain = adamw(net.parameters(), lr=settings.lr)
        return net, plain, lambda: net.perform_slowmo(plain)
    raise ValueError(f"unknown strategy {name!r}")


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]


class _Run:
    """One strategy being trained on this rank."""

    def __init__(self, name: str, settings: MultinodeSettings, task: MarkovTask) -> None:
        self.settings = settings
        self.task = task
        self.result = NodeResult(name)
        self.group = dist.new_group()  # its own group: strategies never see each other's collectives
        self.built: Optional[Built] = None
        try:
            torch.manual_seed(settings.seed)
            self.built = build(name, TransformerLM(settings.lm), self.group, settings)
        except Exception as exc:
            self.result.error = _short(exc)

    def step(self, step: int, meter: Optional[CommMeter], slow: bool) -> Optional[float]:
        """One training step; its seconds (None after a failure)."""
        if self.built is None:
            return None
        model, optimizer, after_step = self.built
        rank = dist.get_rank()
        gen = torch.Generator().manual_seed((self.settings.seed * 1_000_003 + rank) * 1_000_003 + step)
        tokens, targets = self.task.batch(self.settings.batch_size, self.settings.lm.seq_len, gen)
        s = self.settings
        link = comm_delay(s.latency_s, s.bandwidth_bytes_per_s, scope="inter_node") if slow else None
        try:
            collectives.barrier(self.group, "bench.multinode.step_start")  # outside the slow link
            with link or contextlib.nullcontext(), count_comm_bytes(meter or CommMeter()):
                start = time.perf_counter()
                loss = TransformerLM.loss_fn(model(tokens), targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                after_step()
                seconds = time.perf_counter() - start
            self.result.losses.append(float(loss.detach()))
            return seconds
        except Exception as exc:
            self.result.error = _short(exc)
            self.built = None
            return None

    def finish(self, meter: CommMeter) -> NodeResult:
        """The measurements, with bytes averaged over the timed fast-link steps."""
        self.result.inter_node_bytes = meter.total_inter_node_bytes // self.settings.steps
        self.result.intra_node_bytes = meter.total_intra_node_bytes // self.settings.steps
        self.built = None
        return self.result


def worker(settings: MultinodeSettings) -> list[NodeResult]:
    """One rank: build every strategy, train them interleaved (step ``s`` of each before step ``s + 1`` of any,
    order rotated each step, so background load hits all alike), first on the fast link, then on the slow one."""
    dist.init_process_group("gloo")
    set_topology(Topology.from_env(nprocs_per_node=settings.nproc_per_node))  # the meter's view of the nodes
    task = MarkovTask.create(settings.lm.vocab_size, seed=settings.seed)
    runs = [_Run(name, settings, task) for name in settings.strategies]
    meters = [CommMeter() for _ in runs]
    step = 0
    for slow in (False, True):
        for i in range(settings.warmup + settings.steps):
            timed = i >= settings.warmup
            shift = step % len(runs)
            for index in list(range(shift, len(runs))) + list(range(shift)):
                run, meter = runs[index], meters[index]
                seconds = run.step(step, meter if timed and not slow else None, slow)
                if seconds is not None and timed:
                    (run.result.slow_step_s if slow else run.result.fast_step_s).append(seconds)
            _agree_on_failures(runs)
            step += 1
    results = [run.finish(meter) for run, meter in zip(runs, meters)]
    dist.destroy_process_group()
    return results


def _agree_on_failures(runs: list[_Run]) -> None:
    """Stop, on every rank, each strategy that failed on any rank (its peers would wait in its collectives)."""
    flags = torch.tensor([0 if run.built is not None else 1 for run in runs], dtype=torch.int32)
    collectives.all_reduce(flags, op=dist.ReduceOp.MAX, label="bench.multinode.failed")
    for run, flag in zip(runs, flags.tolist()):
        if flag and run.built is not None:
            run.built = None
            run.result.error = "failed on another rank"


def launch(settings: MultinodeSettings) -> tuple[list[list[NodeResult]], str]:
    """Run :func:`worker` as ``nnodes`` torch elastic agents (two-node harness); returns per-rank results and
    how it was launched."""
    from shardkit.testing.multinode import run_nodes

    per_rank = run_nodes(
        worker,
        settings,
        nnodes=settings.nnodes,
        nproc_per_node=settings.nproc_per_node,
        timeout_s=settings.timeout_s,
        env={"OMP_NUM_THREADS": "1"},
    )
    how = f"{settings.nnodes} torch elastic agents x {settings.nproc_per_node} processes, c10d rendezvous on 127.0.0.1"
    return per_rank, how


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
        error = next((r.error for r in same if r.error and r.error != "failed on another rank"), None)
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


if __name__ == "__main__":
    # Through the package module, so the settings pickle under its importable name for the agents.
    from shardkit.bench.multinode import run as _run_suite

    _run_suite(sys.argv[1:])
