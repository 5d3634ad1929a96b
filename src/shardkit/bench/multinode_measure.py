"""Workers of ``shardkit bench multinode``: build each strategy, train them on two nodes, count bytes and time steps.

:func:`launch` starts :func:`worker` as ``nnodes`` torch elastic agents of ``nproc_per_node`` processes each
(:func:`shardkit.testing.multinode.run_nodes`); every rank builds every strategy (:func:`build`), trains them
interleaved step by step on the fast link and then on the slow one, and returns one :class:`NodeResult` per strategy.
The table and the command line are in :mod:`shardkit.bench.multinode`.

Example::

    per_rank, how = launch(MultinodeSettings(strategies=("fsdp", "fsdp_hybrid"), steps=2, warmup=1))
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.bench.ddp_hook import labelled_allreduce_hook
from shardkit.demo.task import MarkovTask
from shardkit.distributed import CommMeter, collectives, comm_delay, count_comm_bytes
from shardkit.distributed.node_traffic import set_topology
from shardkit.distributed.topology import Topology
from shardkit.models import LMConfig, TransformerLM
from shardkit.strategies.registry import Built, OptimizerSpec, get_strategy
from shardkit.testing.multinode import run_nodes
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

#: The error a strategy gets on the ranks where it did not fail itself (stopped because another rank failed).
FAILED_ELSEWHERE = "failed on another rank"


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


#: Each suite row: its registry strategy and options (prefetch one block ahead, as the zero suite's fsdp row).
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {"sharding_strategy": "FULL_SHARD", **get_strategy("fsdp").defaults}),
    "fsdp_hybrid": ("fsdp", {"sharding_strategy": "HYBRID_SHARD", **get_strategy("fsdp").defaults}),
    "oss_sdp": ("oss_sdp", {}),
    "oss_sdp_hybrid": ("oss_sdp", {"hybrid": True}),
    "slowmo": ("slowmo", {}),
}


def build(name: str, model: nn.Module, group: dist.ProcessGroup, settings: MultinodeSettings) -> Built:
    """``(model, optimizer, after_step)`` for strategy ``name`` over ``group`` (the whole job), from the registry;
    the hybrid rows shard inside the nodes of ``settings.nproc_per_node`` ranks."""
    if name not in ROWS:
        raise ValueError(f"unknown strategy {name!r}")
    entry, options = ROWS[name]
    nodes = Topology.from_env(group, nprocs_per_node=settings.nproc_per_node)
    adamw = OptimizerSpec(torch.optim.AdamW, {"lr": settings.lr})
    built = get_strategy(entry).build(model, adamw, group, options, nodes)
    if isinstance(built[0], nn.parallel.DistributedDataParallel):  # labelled: the byte counter sees DDP's all-reduce
        built[0].register_comm_hook(group, labelled_allreduce_hook)
    return built


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
            run.result.error = FAILED_ELSEWHERE


def launch(settings: MultinodeSettings) -> tuple[list[list[NodeResult]], str]:
    """Run :func:`worker` as ``nnodes`` torch elastic agents (two-node harness); returns per-rank results and
    how it was launched."""

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
