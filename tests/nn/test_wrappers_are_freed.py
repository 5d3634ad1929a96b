"""A wrapped model that the script lets go of is freed: its parameters, optimizer state and process groups with it.

With torch 2.13 a tensor that C++ also holds keeps its Python object, and its hooks, alive from C++, an edge the
cycle collector cannot see; a wrapper's hook that was a bound method of the wrapper closed a cycle never freed.
Before ``shardkit.utils.autograd.weak_method_hook`` FSDP (any world size) and ShardedDataParallel (2 ranks) were
still alive after ``del`` and ``gc.collect()``: a script building models in a loop kept every one, and their gloo
groups lived into the interpreter's finalisation (RELIABILITY.md, the abort at exit).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import torch
from torch import nn

from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel, SlowMoDistributedDataParallel
from shardkit.optim import OSS
from shardkit.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _fsdp() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = FullyShardedDataParallel(_model())
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _sdp() -> tuple[nn.Module, torch.optim.Optimizer]:
    inner = _model()
    optimizer = OSS(inner.parameters(), optim=torch.optim.SGD, lr=0.1)
    return ShardedDataParallel(inner, optimizer), optimizer


def _slowmo() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = SlowMoDistributedDataParallel(_model(), nprocs_per_node=2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


WRAPPERS: dict[str, Callable[[], tuple[nn.Module, torch.optim.Optimizer]]] = {
    "fsdp": _fsdp,
    "sdp": _sdp,
    "slowmo": _slowmo,
}


def _train_then_drop(name: str, rank: int) -> tuple[weakref.ref[Any], weakref.ref[Any]]:
    model, optimizer = WRAPPERS[name]()
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x).square().mean().backward()
        optimizer.step()
        if hasattr(model, "perform_slowmo"):
            model.perform_slowmo(optimizer)
        optimizer.zero_grad()
    return weakref.ref(model), weakref.ref(optimizer)


def _every_wrapper(rank: int, world_size: int) -> dict[str, bool]:
    freed = {}
    for name in WRAPPERS:
        model_ref, optimizer_ref = _train_then_drop(name, rank)
        gc.collect()
        freed[name] = model_ref() is None and optimizer_ref() is None
    return freed


def test_every_wrapper_is_freed_once_dropped() -> None:
    for rank, freed in enumerate(run_distributed(_every_wrapper, 2)):
        assert freed == dict.fromkeys(WRAPPERS, True), f"rank {rank}: {freed}"
