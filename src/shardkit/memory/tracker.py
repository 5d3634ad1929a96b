"""``MemoryTracker``: per-rank tensor memory by category, current and peak, and per module.

Built on torch's dispatch modes (:class:`torch.utils._python_dispatch.TorchDispatchMode`, the mechanism of
``torch.distributed._tools.mem_tracker``): every operator's outputs pass through the tracker, which counts
each new storage under a category chosen by *when* it was created, and re-labels storages once their role is
known:

- inside ``optimizer.step()`` → optimizer state; inside backward → temporaries; inside a module's forward →
  activations; anywhere else → temporaries;
- tensors a module holds when its forward starts (its parameters, buffers, and plain tensor attributes such as
  the views sharded wrappers install) → parameters; a parameter's ``.grad`` → gradients; what an optimizer
  keeps in ``state`` → optimizer state. :func:`tag` lets library code label a tensor explicitly.

Storages resized outside operators (``UntypedStorage.resize_``, how FSDP implementations free full parameters)
are followed by wrapping that method while the tracker is active. Only storages created (or resized, or
named through :meth:`MemoryTracker.watch`) while tracking are counted: enter the tracker before building the
model to count everything. The tracker costs a Python call per operator: use it for measuring, not timing.

Example::

    with MemoryTracker() as tracker:
        model, optim = build()
        tracker.watch(model, optim)
        train_step(model, optim)           # warm-up: optimizer state appears
        tracker.reset_peak()
        train_step(model, optim)
    print(tracker.peak.format(), tracker.current[Category.OPTIMIZER_STATE])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from shardkit.memory._book import Category, MemorySnapshot, StorageBook
from shardkit.memory.resize_watch import watch_resizes
from shardkit.utils._torch_private import (
    TorchDispatchMode,
    current_dispatch_mode_stack,
    dtensor_local_tensor,
    is_in_torch_dispatch_mode,
    tree_flatten,
)
from shardkit.utils.autograd import backward_running

_PATCH_MARK = "_shardkit_memory_tracker"


@dataclass
class ModuleMemory:
    """What one module's forward did to memory (the last call, and the peak over all calls)."""

    name: str
    calls: int = 0
    #: Highest total seen while its forward ran.
    forward_peak: int = 0
    #: Total bytes alive when its forward returned minus when it started (activations it leaves behind).
    retained: int = 0


_PLAIN = (torch.Tensor, nn.Parameter)


def _is_dtensor_type(cls: type) -> bool:
    return any(base.__name__ == "DTensor" for base in cls.__mro__)


def _storage(tensor: torch.Tensor) -> Optional[torch.UntypedStorage]:
    local = dtensor_local_tensor(tensor)  # DTensor parameters (torch FSDP2): the rank's shard
    if local is not None:
        tensor = local
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse / nested / tensors without a storage
        return None


def _state_tensors(value: Any) -> Iterator[torch.Tensor]:
    for item in tree_flatten(value)[0]:
        if isinstance(item, torch.Tensor):
            yield item


class MemoryTracker(TorchDispatchMode):
    """Count this process's tensor storages by :class:`Category` while active (see the module docstring).

    Args:
        device: count only storages on this device (type, like ``"cuda"``, or a full device); None counts all.
    """

    def __init__(self, device: Optional[Union[str, torch.device]] = None) -> None:
        super().__init__()
        self._device = torch.device(device) if device is not None else None
        self._book = StorageBook()
        self._models: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._names: dict[int, str] = {}
        self._stack: list[tuple[nn.Module, int, list[int]]] = []
        self._in_optimizer = 0
        #: Per-module forward statistics, by module name.
        self.modules: dict[str, ModuleMemory] = {}
        self._handles: list[Any] = []
        self._unwatch: Callable[[], None] = lambda: None

    # ------------------------------------------------------------------ public API
    def watch(
        self, model: Optional[nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None
    ) -> MemoryTracker:
        """Name ``model``'s modules and count its parameters, gradients and ``optimizer``'s state (now and later)."""
        if model is not None:
            self._models.append(model)
            for name, module in model.named_modules():
                self._names.setdefault(id(module), name or type(model).__name__)
        if optimizer is not None:
            self._optimizers.append(optimizer)
        self.refresh()
        return self

    def refresh(self) -> None:
        """Re-label the storages of watched parameters, gradients and optimizer state."""
        for model in self._models:
            self._label(model.parameters(), Category.PARAMETERS)
            self._label(model.buffers(), Category.PARAMETERS)
            self._label((p.grad for p in model.parameters() if p.grad is not None), Category.GRADIENTS)
        for optimizer in self._optimizers:
            self._label_optimizer(optimizer)

    @property
    def current(self) -> MemorySnapshot:
        """Bytes alive now, by category."""
        self.refresh()
        return self._book.snapshot()

    @property
    def peak(self) -> MemorySnapshot:
        """Bytes by category at the moment the total was highest (since entering or :meth:`reset_peak`)."""
        return self._book.peak_snapshot()

    def reset_peak(self) -> None:
        """Start measuring the peak again from what is alive now (and clear per-module statistics)."""
        self.refresh()
        self._book.reset_peak()
        self.modules.clear()

    def tag(self, tensor: torch.Tensor, category: Category) -> None:
        """Count ``tensor``'s storage under ``category`` from now on."""
        self._label((tensor,), category)

    def report(self, top: int = 10) -> str:
        """Current and peak by category, and the modules with the highest forward peaks."""
        lines = [f"current: {self.current.format()}", f"peak:    {self.peak.format()}"]
        ranked = sorted(self.modules.values(), key=lambda m: m.forward_peak, reverse=True)[:top]
        for m in ranked:
            lines.append(
                f"  {m.name}: forward peak {m.forward_peak / 2**20:.1f} MiB, retained {m.retained / 2**20:.1f} MiB"
            )
        return "\n".join(lines)

    # ------------------------------------------------------------------ labelling
    def _wanted(self, tensor: torch.Tensor) -> bool:
        device = self._device
        if tensor.device.type == "meta":
            return False
        if device is None:
            return True
        return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)

    def _label(self, tensors: Iterable[Optional[torch.Tensor]], category: Category) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and self._wanted(tensor):
                storage = _storage(tensor)
                if storage is not None:
                    self._book.track(storage, category, override=True)

    def _label_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            self._label(_state_tensors(state), Category.OPTIMIZER_STATE)
        self._label(
            (p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None),
            Category.GRADIENTS,
        )

    def _category_now(self) -> Category:
        if self._in_optimizer:
            return Category.OPTIMIZER_STATE
        if backward_running():
            return Category.TEMPORARIES
        if self._stack:
            return Category.ACTIVATIONS
        return Category.TEMPORARIES

    # ------------------------------------------------------------------ the dispatch mode
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(_is_dtensor_type(t) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here with plain tensors
        out = func(*args, **(kwargs or {}))
        category = self._category_now()
        for tensor in tree_flatten(out)[0]:
            # Only plain tensors own real memory (fake tensors of sharding propagation, wrappers, ... do not).
            if type(tensor) in _PLAIN and self._wanted(tensor):
                storage = _storage(tensor)
                if storage is not None:
                    self._book.track(storage, category)
        if self._stack:
            current = self._book.current
            for _, _, peak in self._stack:
                if current > peak[0]:
                    peak[0] = current
        return out

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self._label(module._parameters.values(), Category.PARAMETERS)
        self._label(module._buffers.values(), Category.PARAMETERS)
        self._label((v for v in vars(module).values() if isinstance(v, torch.Tensor)), Category.PARAMETERS)
        current = self._book.current
        self._stack.append((module, current, [current]))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        while self._stack:
            entered, start, peak = self._stack.pop()
            if entered is module:
                break
        else:
            return
        name = self._names.get(id(module), type(module).__name__)
        stats = self.modules.setdefault(name, ModuleMemory(name))
        stats.calls += 1
        stats.forward_peak = max(stats.forward_peak, peak[0])
        stats.retained = self._book.current - start

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._in_optimizer == 0:
            self.refresh()
            self._label_optimizer(optimizer)
        self._in_optimizer += 1

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._in_optimizer = max(0, self._in_optimizer - 1)
        self._label_optimizer(optimizer)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type != "meta" and (self._device is None or storage.device.type == self._device.type):
            self._book.resized(storage)

    def __enter__(self) -> MemoryTracker:
        busy = "another MemoryTracker is already active in this process; use one at a time"
        self._unwatch = watch_resizes(self._resized, _PATCH_MARK, busy)
        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_forward_pre_hook(self._pre_forward),
            hooks.register_module_forward_hook(self._post_forward, always_call=True),
            register_optimizer_step_pre_hook(self._optimizer_pre),
            register_optimizer_step_post_hook(self._optimizer_post),
        ]
        super().__enter__()
        self.refresh()
        self._book.reset_peak()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._unwatch()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()
        self.refresh()


def tag(tensor: torch.Tensor, category: Category) -> None:
    """Tell an active :class:`MemoryTracker` (if any, on this thread) what ``tensor`` holds; costs nothing otherwise.

    Example::

        full = torch.empty(numel)
        tag(full, Category.PARAMETERS)     # gathered parameters, not an activation
    """
    if not is_in_torch_dispatch_mode():
        return
    for mode in current_dispatch_mode_stack():
        if isinstance(mode, MemoryTracker):
            mode.tag(tensor, category)
            return
