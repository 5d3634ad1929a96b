"""The workers of ``shardkit bench tp``: build each variant on this rank, time its steps, count its bytes and memory.

A variant is one way to train :func:`shardkit.models.tp_lm.tp_lm` on this rank: shardkit's tensor-parallel layers,
the same ``nn.Linear`` model split by torch's ``parallelize_module``, FSDP over the world, or the tensor-parallel
model with FSDP over the data-parallel ranks. The variants of one comparison start from the same weights and step
in turn (each timed step behind a barrier, so load on the machine hits all alike). Bytes and peak memory are taken
in one more, untimed step, under shardkit's comm meter (shardkit's collectives) and a dispatch mode that counts
torch's functional collectives (what torch's tensor parallelism issues), with :class:`~shardkit.memory.MemoryTracker`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from shardkit import tensor_parallel as tp
from shardkit.bench._torch_private import process_group_size
from shardkit.distributed import CommMeter, count_comm_bytes
from shardkit.memory import MemoryTracker
from shardkit.models.tp_lm import TPLM, torch_tp_plan, tp_lm
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.plan.workloads import next_token_cross_entropy
from shardkit.tensor_parallel import step_check
from shardkit.utils._torch_private import TorchDispatchMode

#: The tensor-parallel projections of each block, whose per-rank parameters the bench reports.
SPLIT = ("q", "k", "v", "qkv", "o", "up", "down")


@dataclass(frozen=True)
class TPBenchSettings:
    """The model, batch and schedule; plain data handed to every worker."""

    dim: int = 256
    heads: int = 8
    layers: int = 4
    vocab: int = 1024
    #: Sequences per tensor-parallel group (FSDP alone: this divided by the degree, per rank: the same global batch).
    batch: int = 4
    seq: int = 128
    tensor: int = 2
    steps: int = 8
    warmup: int = 2
    seed: int = 0


@dataclass
class Measured:
    """One variant on one rank."""

    name: str
    step_s: list[float] = field(default_factory=list)
    wire_bytes: int = 0
    peak_bytes: int = 0
    split_params: int = 0
    first_loss: float = float("nan")

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s) if self.step_s else float("nan")


class TorchCollectives(TorchDispatchMode):
    """Counts the bytes one rank sends in torch's functional collectives (ring model, as shardkit's meter)."""

    def __init__(self) -> None:
        super().__init__()
        self.wire_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith("_c10d_functional.") and "wait_tensor" not in name and "wrap" not in name:
            payload = args[0].numel() * args[0].element_size()
            n = process_group_size(args[-1])
            if "all_reduce" in name:
                self.wire_bytes += 2 * (n - 1) * payload // n
            elif "all_gather" in name:
                self.wire_bytes += (n - 1) * payload
            else:  # reduce-scatter: (n - 1) / n of the full input
                self.wire_bytes += (n - 1) * payload // n
        return func(*args, **(kwargs or {}))


class Variant:
    """A model and its AdamW on this rank, fed ``tokens`` (this rank's batch) each step."""

    def __init__(self, name: str, model: nn.Module, tokens: torch.Tensor) -> None:
        self.model, self.tokens = model, tokens
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.result = Measured(name, split_params=split_params(model))

    def step(self) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = next_token_cross_entropy(self.model(self.tokens), (self.tokens,))
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def measure_once(self) -> None:
        """One untimed step under the byte counters and the memory tracker (without the TP step check's
        all-gather of four numbers: the bytes are the algorithm's; the timed steps include the check)."""
        meter, torch_counter = CommMeter(), TorchCollectives()
        with MemoryTracker() as tracker, torch_counter, count_comm_bytes(meter), step_check.suspended():
            tracker.watch(self.model, self.optimizer)
            tracker.reset_peak()
            self.step()
        self.result.wire_bytes = meter.total_wire_bytes + torch_counter.wire_bytes
        self.result.peak_bytes = tracker.peak.total


def split_params(model: nn.Module) -> int:
    """Parameters of the split projections held on this rank (a DTensor's local shard)."""
    total = 0
    for name, param in model.named_parameters():
        parts = name.split(".")
        if len(parts) > 1 and parts[-2] in SPLIT:
            local = param.to_local() if hasattr(param, "to_local") else param
            total += local.numel()
    return total


def _full_model(s: TPBenchSettings) -> TPLM:
    torch.manual_seed(s.seed)
    return tp_lm(parallel=False, vocab=s.vocab, dim=s.dim, heads=s.heads, layers=s.layers)


def _shardkit_tp(s: TPBenchSettings) -> nn.Module:
    """shardkit's split model holding this rank's slices of the full model's weights."""
    model = tp_lm(parallel=True, vocab=s.vocab, dim=s.dim, heads=s.heads, layers=s.layers)
    full = _full_model(s).state_dict()
    model.load_state_dict(tp.split_state_dict(full, tp.tp_sharding(model), s.tensor)[tp.current_state().tp_rank])
    return model


def _torch_tp(s: TPBenchSettings) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    model = _full_model(s)
    return parallelize_module(model, tp.current_state().tp_mesh, torch_tp_plan(model))


def _fsdp(model: nn.Module, group: Any) -> nn.Module:
    blocks: Any = model.blocks
    for i, block in enumerate(blocks):
        blocks[i] = FSDP(block, process_group=group)
    return FSDP(model, process_group=group)


def _tokens(s: TPBenchSettings, rows: int, shard: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(s.seed * 1_000_003 + shard)
    return torch.randint(0, s.vocab, (rows, s.seq), generator=gen)


def _run(variants: list[Variant], s: TPBenchSettings) -> list[Measured]:
    for v in variants:
        v.result.first_loss = v.step()
    for step in range(s.warmup - 1 + s.steps):
        shift = step % len(variants)
        for v in variants[shift:] + variants[:shift]:
            dist.barrier()
            start = time.perf_counter()
            v.step()
            if step >= s.warmup - 1:
                v.result.step_s.append(time.perf_counter() - start)
    for v in variants:
        dist.barrier()
        v.measure_once()
    return [v.result for v in variants]


def worker(s: TPBenchSettings) -> dict[str, list[Measured]]:
    """Both comparisons on this rank: TP (shardkit against torch), then TP x FSDP against FSDP alone."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    state = tp.init_parallel_state(tensor=s.tensor)
    tp_rows = s.batch
    group_tokens = _tokens(s, tp_rows, state.coords.data)  # the same on every rank of a TP group
    tensor = _run(
        [Variant("shardkit TP", _shardkit_tp(s), group_tokens), Variant("torch TP", _torch_tp(s), group_tokens)], s
    )
    world = dist.get_world_size()
    data = state.group("data")
    fsdp_rows = s.batch * state.layout.data // world  # the same global batch as TP x FSDP
    builds: list[tuple[str, Callable[[], nn.Module], torch.Tensor]] = [
        (f"FSDP x{world}", lambda: _fsdp(_full_model(s), None), _tokens(s, fsdp_rows, 100 + dist.get_rank())),
        (f"TP {s.tensor} x FSDP {state.layout.data}", lambda: _fsdp(_shardkit_tp(s), data), group_tokens),
    ]
    two_d = _run([Variant(name, build(), tokens) for name, build, tokens in builds], s)
    tp.set_current_state(None)
    dist.destroy_process_group()
    return {"tp": tensor, "2d": two_d}


__all__ = ["Measured", "TPBenchSettings", "TorchCollectives", "split_params", "worker"]
