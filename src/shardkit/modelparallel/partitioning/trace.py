"""Tracing the model on one micro-batch: module execution order, compute and memory per module.

The trace runs the full model once (on the first ``@smp.step``, before the partition) with hooks on every
module and a dispatch mode that estimates each operator's cost: matmul-like operators by their FLOP formula
(torch's own registry), attention by ``4 * numel(q) * len(k)``, everything else by the elements it writes.
With ``trace_execution_times=True`` a second, unhooked-by-dispatch pass measures each module's wall time,
which then replaces the FLOP estimate. With ``trace_memory_usage=True`` another pass runs with autograd
recording, under :class:`~shardkit.memory.MemoryTracker`, and measures what each module really leaves alive
for backward (its saved activations and outputs), which replaces the estimate from the bytes its operators
write. Buffers and the RNG are restored afterwards, so tracing leaves no trace. :func:`traced_on` runs all this
on another device than the one the model lives on (smp's ``trace_device``).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from shardkit.memory.tracker import MemoryTracker
from shardkit.utils._torch_private import TorchDispatchMode, tree_leaves
from shardkit.utils.torch_compat import autocast_cache_off

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
    measured_bytes: Optional[int] = None
    """Measured bytes its calls leave alive for backward, when ``trace_memory_usage`` is on."""
    children: list[str] = field(default_factory=list)

    @property
    def compute(self) -> float:
        """Measured time when available, else the FLOP estimate."""
        return self.time_s if self.time_s is not None else self.flops

    @property
    def memory_bytes(self) -> int:
        """Parameters plus activations: measured activations when available, else the estimate."""
        activations = self.measured_bytes if self.measured_bytes is not None else self.activation_bytes
        return self.param_bytes + activations


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def op_cost(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    """Estimated cost of one operator call: its FLOPs when torch knows a formula, else the elements it writes."""
    if getattr(func, "is_view", False):
        return 0.0
    packet = getattr(func, "overloadpacket", func)
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


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside (lists, tuples, named tuples, dicts) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device) if value.device != device else value
    if isinstance(value, (list, tuple)):
        items = [to_device(v, device) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return type(value)((k, to_device(v, device)) for k, v in value.items())
    return value


@contextlib.contextmanager
def traced_on(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Parameters and buffers on ``device`` inside, back on their own tensors (the same data) afterwards.

    The same parameter objects are kept (only ``.data`` is swapped), so nothing outside sees a different
    module; the original storage is held meanwhile, so tracing elsewhere costs one copy of the model there.
    """
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.device != device and all(tensor is not t for t, _ in moved):
                    moved.append((tensor, tensor.data))
                    tensor.data = tensor.data.to(device)
        yield
    finally:
        for tensor, original in moved:
            tensor.data = original


#: True while this thread runs one of the partitioner's extra forwards (``smp.is_tracing()``). A ContextVar: the
#: user's forward reads it on the thread that runs the trace.
_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("shardkit_smp_tracing", default=False)


def is_tracing() -> bool:
    """True while this process runs the forward that traces the model to decide the partition (smp's
    ``smp.is_tracing()``): a model's ``forward`` can skip work that only matters in training steps."""
    return _TRACING.get()


def _eager() -> contextlib.AbstractContextManager[Any]:
    """Compiled modules run eagerly: compiled, they would trace the hooks and modes that watch the forward into
    their graphs. Nothing is compiled while dynamo was never imported (importing it only to say so is slow)."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


@contextlib.contextmanager
def side_effect_free(module: nn.Module, record_autograd: bool = False) -> Iterator[None]:
    """Run extra forwards without changing the model: buffers (BatchNorm statistics) and RNG are restored.

    Autograd is off unless ``record_autograd`` (the memory pass needs the tensors backward would keep).
    :func:`is_tracing` is True inside.
    """
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({b.device.index for b, _ in saved if b.device.type == "cuda" and b.device.index is not None})
    token = _TRACING.set(True)
    try:
        # The cache off: a parameter's cast made here under no_grad must not stand in for the step's own cast.
        with (
            torch.random.fork_rng(devices=devices),
            torch.set_grad_enabled(record_autograd),
            autocast_cache_off(),
            _eager(),
        ):
            yield
    finally:
        _TRACING.reset(token)
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)


def trace_costs(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    measure_time: bool = False,
    measure_memory: bool = False,
) -> dict[str, ModuleCost]:
    """Run ``module(*args, **kwargs)`` once and return every module's :class:`ModuleCost` by name.

    ``measure_time`` adds measured wall times, ``measure_memory`` measured activation bytes (one more
    forward each).

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
    if measure_memory:
        _measure_memory(module, args, kwargs, costs)
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


def _measure_memory(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], costs: dict[str, ModuleCost]
) -> None:
    """Each module's bytes left alive by its forward with autograd recording (the activations backward needs).

    The tracker counts only storages created on the parameters' device during this forward. A module called
    several times is charged its last call's retention times its number of calls.
    """
    first = next(iter(module.parameters()), None)
    device = first.device if first is not None else None
    tracker = MemoryTracker(device=device)
    try:
        with side_effect_free(module, record_autograd=True), tracker:
            tracker.watch(module)
            output = module(*args, **kwargs)
            del output  # drops the graph: the activations are freed before the tracker closes
    except RuntimeError as exc:
        if "already active" not in str(exc):
            raise
        warnings.warn(
            "smp trace_memory_usage=True: another MemoryTracker is active in this process, so module memory "
            "could not be measured; the partition uses the estimate from tensor sizes",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    root_label = type(module).__name__
    for name, cost in costs.items():
        stats = tracker.modules.get(name or root_label)
        cost.measured_bytes = max(0, stats.retained) * stats.calls if stats is not None else 0
