"""Per-rank memory of a training setup, counted from the tensors it actually holds.

Every strategy keeps its parameters, gradients and optimizer state differently (flat buffers, views into
buckets, shards, DTensors), so instead of asking each wrapper what it thinks it holds, :func:`training_memory`
walks the tensors reachable from ``model.parameters()``, their ``.grad`` and the optimizer's state and adds up
the *storages* behind them, each storage counted once. A flat buffer with many views counts once, a freed
(resized to zero) buffer counts nothing, and a sharded optimizer counts only the state of its local shard.

What is not counted: activations, temporary all-gathered parameters during forward/backward, and buffers a
wrapper keeps outside parameters, gradients and optimizer state (for example torch DDP's gradient buckets when
``gradient_as_bucket_view=False``). Measure after ``optimizer.step()`` and before ``zero_grad()`` to see the
steady state with gradients present.

Example::

    loss.backward()
    optimizer.step()
    print(training_memory(model, optimizer).total)
    optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes held by one rank: parameters, gradients and optimizer state (each storage counted once)."""

    params: int
    grads: int
    optim_state: int

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optim_state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a DTensor (torch FSDP2 parameters), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class _StorageCounter:
    """Adds up distinct storages; a storage seen before (another view, a tied weight) adds nothing."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def count(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for tensor in tensors:
            storage = _local(tensor).untyped_storage()
            key = storage.data_ptr()
            nbytes = storage.nbytes()
            if nbytes == 0 or key in self._seen:
                continue
            self._seen.add(key)
            total += nbytes
        return total


def _state_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside one optimizer-state value (tensors, or dicts/lists/tuples of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _state_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _state_tensors(item)


def _optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizer and, for sharding wrappers (shardkit OSS, torch ZeroRedundancyOptimizer), the local one.

    Wrappers keep the rank's shard in a local optimizer at ``.optim``; their own ``.state`` may mirror it or
    stay empty, and counting storages once makes both cases right.
    """
    found = [optimizer]
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        found.extend(_optimizers(inner))
    return found


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """All tensors in the optimizer's per-parameter state, including a sharding wrapper's local optimizer."""
    tensors: list[torch.Tensor] = []
    for opt in _optimizers(optimizer):
        for per_param in opt.state.values():
            tensors.extend(_state_tensors(per_param))
    return tensors


def training_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> MemoryBreakdown:
    """Bytes of parameters, gradients and optimizer state this rank holds right now (see the module docstring)."""
    counter = _StorageCounter()
    params = list(model.parameters())
    param_bytes = counter.count(params)
    grad_bytes = counter.count(p.grad for p in params if p.grad is not None)
    state_bytes = counter.count(optimizer_state_tensors(optimizer))
    return MemoryBreakdown(param_bytes, grad_bytes, state_bytes)


def format_bytes(nbytes: float) -> str:
    """Human-readable size with binary units (``'118.3 MiB'``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
