"""One small model under every strategy family, trained so that every family at every world size follows the same
trajectory as one process on the whole batch; the pieces of the any-to-any checkpoint tests.

Why the trajectories agree: every family averages the gradient of the same global batch (8 rows, split evenly
between data-parallel ranks; smp's micro-batches are averaged too), and SGD with momentum is linear in the
gradients. SlowMo runs LocalSGD averaging every step with slow momentum off, so its average parameters and
average momentum follow the single-process run as well, while each rank's own momentum differs (what the
checkpoint must average). The model has no dropout; its buffer depends on the seed, so a target built with
another seed only matches if the buffer was loaded too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.strategies.options import nothing
from shardkit.strategies.registry import OptimizerSpec, get_strategy
from testkit import data_parallel_rows, regression_batch, train_step, units_at

#: Families the parity tests move checkpoints between, and the world sizes each runs at here.
FAMILY_SIZES: dict[str, tuple[int, ...]] = {
    "plain": (1,),
    "ddp": (2, 4),
    "oss": (1, 2, 4),
    "oss_sdp": (1, 2, 4),
    "fsdp_nested": (1, 2, 4),
    "fsdp_noflat": (1, 2, 4),
    "smp": (1, 2, 4),
    "slowmo": (2, 4),
}
#: Environment of each of four ranks simulating two torchrun nodes of two processes (for ``fsdp_hybrid``).
TWO_NODES = [{"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2), "LOCAL_RANK": str(r % 2)} for r in range(4)]
GLOBAL_BATCH = 8
LR, MOMENTUM = 0.05, 0.9


class Gain(nn.Module):
    """Multiplies by a persistent buffer (so checkpoints carry a buffer)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.register_buffer("gain", torch.full((3,), value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def net(seed: int) -> nn.Sequential:
    """Linear(6, 8) - Tanh - Linear(8, 8) - Tanh - Linear(8, 3) - Gain, weights and gain from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3), Gain(1.0 + 0.25 * seed)
    )


@dataclass
class Run:
    """A model of one family with its optimizer, and this rank's data-parallel coordinates."""

    family: str
    model: Any
    optimizer: Any
    dp_rank: int
    dp_size: int
    after_step: Callable[[], None] = nothing


def _sgd() -> OptimizerSpec:
    return OptimizerSpec(torch.optim.SGD, {"lr": LR, "momentum": MOMENTUM})


def _registry_entry(family: str, module: nn.Sequential, mixed_precision: bool) -> tuple[str, dict[str, Any], Any]:
    """The registry strategy a family is, its options, and the node topology it needs (``fsdp_hybrid``)."""
    if family in ("ddp", "oss_sdp"):
        return family, {}, None
    if family == "oss":
        return "oss_ddp", {}, None
    if family == "slowmo":
        return "slowmo", {"localsgd_frequency": 1, "slowmo_momentum": 0.0, "slowmo_lr": 1.0}, None
    if family not in ("fsdp_nested", "fsdp_noflat", "fsdp_hybrid"):
        raise ValueError(f"unknown family {family}")
    options: dict[str, Any] = {"mixed_precision": True, "compute_dtype": torch.bfloat16} if mixed_precision else {}
    topology = None
    if family == "fsdp_hybrid":  # nodes from LOCAL_WORLD_SIZE; shards in CPU memory (offload)
        from shardkit.distributed import Topology

        topology = Topology.from_env()
        options.update(sharding_strategy="HYBRID_SHARD", cpu_offload=True, compute_device="cpu")
    if family == "fsdp_noflat":
        options.update(auto_wrap_policy=None, flatten_parameters=False)
    else:
        options["auto_wrap_policy"] = units_at(module[0], module[2])
    return "fsdp", options, topology


def build(family: str, rank: int, world_size: int, seed: int, mixed_precision: bool = False) -> Run:
    """``family`` over :func:`net` at this world size (every rank must call it; wrappers synchronise)."""
    module = net(seed)
    if family == "plain":
        return Run(family, module, _sgd().make(module.parameters()), 0, 1)
    if family in ("smp", "smp_p4"):  # pipeline parallelism: no registry entry, built by its own API
        import shardkit.modelparallel as smp

        partitions = 4 if family == "smp_p4" else 1 if world_size == 1 else 2
        smp.init({"partitions": partitions, "microbatches": 2, "ddp": True})
        model = smp.DistributedModel(module)
        optimizer = smp.DistributedOptimizer(_sgd().make(model.parameters()))
        return Run(family, model, optimizer, smp.dp_rank(), smp.dp_size())
    name, options, topology = _registry_entry(family, module, mixed_precision)
    model, optimizer, after_step = get_strategy(name).build(module, _sgd(), None, options, topology)
    return Run(family, model, optimizer, rank, world_size, after_step)


def release(run: Run) -> None:
    """Forget process-wide state (smp allows one model per process)."""
    if run.family.startswith("smp"):
        import shardkit.modelparallel as smp

        smp.reset()


def train(run: Run, steps: range) -> None:
    """Train ``run`` on the global batches of ``steps`` (its data-parallel share of each)."""
    smp_step = None
    if run.family.startswith("smp"):
        from testkit.smp import new_mse_step

        smp_step = new_mse_step()
    for step in steps:
        x, y = regression_batch(500 + step, rows=GLOBAL_BATCH)  # the same for every family and world size
        x, y = (data_parallel_rows(t, run.dp_rank, run.dp_size) for t in (x, y))
        if smp_step is not None:
            run.optimizer.zero_grad()
            smp_step(run.model, x, y)
            run.optimizer.step()
        else:
            # promoted by hand: torch < 2.12's mse_loss backward refuses bf16 against fp32
            train_step(run.model, run.optimizer, lambda _, x=x, y=y: (x, y), loss_fn=_mse_in_float)
        run.after_step()


def _mse_in_float(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y.float())


def full_state(run: Run) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict as float64 CPU tensors (collective for FSDP and smp)."""
    if run.family in ("ddp", "oss", "oss_sdp", "slowmo"):
        state = run.model.module.state_dict()
    else:
        state = run.model.state_dict()
    return {k: v.detach().double().cpu().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, whole batches, ``steps`` steps, from seed 0: what every family must reach."""
    run = build("plain", 0, 1, seed=0)
    train(run, range(steps))
    return full_state(run)
