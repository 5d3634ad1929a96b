"""Tracing the model on one micro-batch: module execution order, compute and memory per module.

The trace runs the full model once (on the first ``@smp.step``, before the partition) with hooks on every
module and a dispatch mode that estimates each operator's cost: matmul-like operators by their FLOP formula
(torch's own registry), attention by ``4 * numel(q) * len(k)``, everything else by the elements it writes.
With ``trace_execution_times=True`` a second, unhooked-by-dispatch pass measures each module's wall time,
which then replaces the FLOP estimate. Buffers and the RNG are restored afterwards, so tracing leaves no trace.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

try:  # torch's FLOP formulas; absent or changed in some versions, then every op is costed by size
    from torch.utils.flop_counter import flop_registry as _FLOP_REGISTRY
except ImportError:  # pragma: no cover
    _FLOP_REGISTRY = {}


@dataclass
class ModuleCost:
    """What the trace saw of one module (inclusive of its children)."""

    name: str
    order: int = -1
    """Position of the module's first call in execution order (-1: never called)."""
    calls: int = 0
    flops: float = 0.0
    """Estimated compute of all its calls."""
    time_s: Optional[float] = None
    """Measured wall time of all its calls, when ``trace_execution_times`` is on."""
    param_bytes: int = 0
    """Bytes of the parameters in its subtree (each counted once)."""
    activation_bytes: int = 0
    """Bytes written by its operators: a proxy for the activations it keeps for backward."""
    children: list[str] = field(default_factory=list)

    @property
    def compute(self) -> float:
        """Measured time when available, else the FLOP estimate."""
        return self.time_s if self.time_s is not None else self.flops


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def op_cost(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    """Estimated cost of one operator call: its FLOPs when torch knows a formula, else the elements it writes."""
    if getattr(func, "is_view", False):
        return 0.0
    packet = getattr(func, "_overloadpacket", func)
    formula = _FLOP_REGISTRY.get(packet)
    if formula is not None:
        with contextlib.suppress(Exception):
            return float(formula(*args, **kwargs, out_val=out))
    if "scaled_dot_product" in str(packet) and len(args) >= 2:
        q, k = args[0], args[1]
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
            return 4.0 * q.numel() * k.shape[-2]
    return float(sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)))


class _CostMode(TorchDispatchMode):
    """Adds each operator's cost and output bytes to the module on top of the stack."""

    def __init__(self, sink: Callable[[float, int], None]) -> None:
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        written = 0 if getattr(func, "is_view", False) else _nbytes(out)
        self.sink(op_cost(func, args, kwargs, out), written)
        return out


@contextlib.contextmanager
def side_effect_free(module: nn.Module) -> Iterator[None]:
    """Run extra forwards without changing the model: buffers (BatchNorm statistics) and RNG are restored."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({b.device.index for b, _ in saved if b.device.type == "cuda" and b.device.index is not None})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)


def trace_costs(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], measure_time: bool = False
) -> dict[str, ModuleCost]:
    """Run ``module(*args, **kwargs)`` once and return every module's :class:`ModuleCost` by name.

    Example::

        costs = trace_costs(model, (tokens,), {})
        print(costs["blocks.0"].flops)
    """
    names = {id(m): name for name, m in module.named_modules()}
    costs = {name: ModuleCost(name) for name in names.values()}
    for name, m in module.named_modules():
        full = (f"{name}.{c}" if name else c for c, _ in m.named_children())
        costs[name].children = [child for child in full if child in costs]  # a shared module is listed once
        costs[name].param_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    self_flops: dict[str, float] = dict.fromkeys(costs, 0.0)
    self_bytes: dict[str, int] = dict.fromkeys(costs, 0)
    stack: list[str] = []
    order = [0]

    def pre(m: nn.Module, _args: Any) -> None:
        name = names[id(m)]
        cost = costs[name]
        if cost.order < 0:
            cost.order = order[0]
            order[0] += 1
        cost.calls += 1
        stack.append(name)

    def post(m: nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()

    def sink(flops: float, written: int) -> None:
        top = stack[-1] if stack else ""
        self_flops[top] += flops
        self_bytes[top] += written

    handles = []
    for m in module.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with side_effect_free(module), _CostMode(sink):
            module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    _fold_children(costs, self_flops, self_bytes)
    if measure_time:
        _measure_times(module, args, kwargs, names, costs)
    return costs


def _fold_children(costs: dict[str, ModuleCost], self_flops: dict[str, float], self_bytes: dict[str, int]) -> None:
    """Turn per-module self costs into inclusive ones (children before parents)."""
    for name in sorted(costs, key=lambda n: -n.count(".") if n else 1):
        cost = costs[name]
        cost.flops = self_flops[name] + sum(costs[c].flops for c in cost.children)
        cost.activation_bytes = self_bytes[name] + sum(costs[c].activation_bytes for c in cost.children)


def _measure_times(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    names: dict[int, str],
    costs: dict[str, ModuleCost],
) -> None:
    starts: dict[str, list[float]] = {}
    totals: dict[str, float] = dict.fromkeys(costs, 0.0)
    cuda = any(p.device.type == "cuda" for p in module.parameters())

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def pre(m: nn.Module, _args: Any) -> None:
        starts.setdefault(names[id(m)], []).append(now())

    def post(m: nn.Module, _args: Any, _out: Any) -> None:
        name = names[id(m)]
        totals[name] += now() - starts[name].pop()

    handles = [h for m in module.modules() for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        with side_effect_free(module):
            module(*args, **kwargs)  # warm-up: first calls pay for allocations and kernel selection
            totals.update(dict.fromkeys(totals, 0.0))
            module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    for name, seconds in totals.items():
        costs[name].time_s = seconds
