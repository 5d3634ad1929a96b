"""Live bytes by category while one planned rank runs, on meta tensors as on real ones.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every operator's outputs. Each new storage is
counted once (however many views it has), by its size now, under a category chosen from *when* it appeared
(optimizer step → optimizer state, backward → temporaries, inside a module's forward → activations, else
temporaries) and re-labelled once its role is known: a module's parameters and buffers when its forward starts
and at every phase boundary, ``.grad`` as soon as autograd accumulates it, optimizer state after the step, and
buffers handed to a collective → communication buffers. A weak reference per storage takes its bytes off when
torch frees it; ``UntypedStorage.resize_`` (how FSDP frees full parameters) is followed too.

Host memory (what a strategy offloads to the CPU: :class:`~shardkit.plan.host.HostTensor` objects) has a book of
its own, with its own peak, beside the device's; :attr:`Accountant.transfers` counts the bytes copied between the two.
The same mode answers data reads from meta tensors (:class:`~shardkit.plan.oracle.MetaData`) and the
``shardkit::to_host`` operator (:mod:`shardkit.plan.host`), so one mode is on the stack.
Planning runs on meta or CPU tensors only, where autograd runs backward on the calling thread, so the
thread-local mode sees backward too.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardkit.memory.offload import TO_HOST
from shardkit.memory.resize_watch import watch_resizes
from shardkit.plan.host import HostTensor, host_copy
from shardkit.plan.oracle import MetaData

aten = torch.ops.aten
#: ``aten::_to_copy`` (a copy to another device or dtype), matched by its registered name.
_COPY_TO = "aten::_to_copy"


class Category(str, enum.Enum):
    """What a planned rank's bytes hold."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    COMM_BUFFERS = "comm_buffers"
    TEMPORARIES = "temporaries"


#: The categories that stay between steps.
STATE = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


@dataclass
class Peak:
    """The highest total seen, by category, with where the step was."""

    total: int = 0
    by_category: dict[str, int] = field(default_factory=dict)
    phase: str = ""
    module: str = ""


class HostMemoryExceeded(MemoryError):
    """A run on real tensors needed more host memory than the planner may use."""

    def __init__(self, needed: int, limit: int) -> None:
        super().__init__(f"needed more than {limit / 2**30:.1f} GiB of host memory (reached {needed / 2**30:.1f} GiB)")
        self.needed = needed
        self.limit = limit


class _Record:
    __slots__ = ("category", "host", "nbytes")

    def __init__(self, category: Category, nbytes: int, host: bool) -> None:
        self.category = category
        self.nbytes = nbytes
        self.host = host


def _storage(tensor: torch.Tensor) -> tuple[torch.UntypedStorage, bool]:
    """The storage that holds ``tensor``'s bytes, and whether it is (planned) host memory."""
    if isinstance(tensor, HostTensor):
        return tensor.meta_tensor.untyped_storage(), True
    return tensor.untyped_storage(), False


#: Tensor types whose storages the accountant counts (a strategy's own subclasses are not unwrapped).
_COUNTED = (torch.Tensor, nn.Parameter, HostTensor)


class Accountant(TorchDispatchMode):
    """Counts storages by :class:`Category` while active (see the module docstring)."""

    def __init__(self, limit_bytes: Optional[int] = None) -> None:
        super().__init__()
        #: Refuse to grow past this many bytes (for runs on real CPU tensors), else None.
        self.limit_bytes = limit_bytes
        self.meta_data = MetaData()
        self._records: dict[int, _Record] = {}
        self._refs: dict[int, Any] = {}
        self.totals: dict[Category, int] = dict.fromkeys(Category, 0)
        self.current = 0
        self.peak = Peak()
        #: Host memory (offloaded state), its peak, and the peak of both memories together.
        self.host_totals: dict[Category, int] = dict.fromkeys(Category, 0)
        self.host_current = 0
        self.host_peak = Peak()
        self.total_peak = 0
        #: Bytes copied so far into host memory (``"to_host"``) and back onto the device (``"to_device"``).
        self.transfers: dict[str, int] = {"to_host": 0, "to_device": 0}
        #: Count new storages as host memory (set by :meth:`in_host_memory`).
        self._new_on_host = False
        self.phase = "setup"
        self._stack: list[str] = []
        self._names: dict[int, str] = {}
        # Re-entrant: a weakref callback (a storage freed by a garbage collection that a dict insert or
        # weakref.ref() under the lock happens to trigger) takes the lock again on the same thread.
        self._lock = threading.RLock()
        self._unwatch: Callable[[], None] = lambda: None
        self._handles: list[Any] = []

    # ---------------------------------------------------------------- bookkeeping
    def _track(
        self, storage: torch.UntypedStorage, category: Category, override: bool = False, host: bool = False
    ) -> None:
        key = id(storage)
        with self._lock:
            record = self._records.get(key)
            if record is None:
                record = _Record(category, 0, host or self._new_on_host)
                self._records[key] = record
                self._refs[key] = weakref.ref(storage, functools.partial(self._forget, key))
            elif override and record.category != category:
                totals = self.host_totals if record.host else self.totals
                totals[record.category] -= record.nbytes
                totals[category] += record.nbytes
                record.category = category
            self._resize(record, storage.nbytes())

    def _resize(self, record: _Record, nbytes: int) -> None:
        delta = nbytes - record.nbytes
        if not delta:
            return
        record.nbytes = nbytes
        if record.host:
            self.host_totals[record.category] += delta
            self.host_current += delta
            if self.host_current > self.host_peak.total:
                self.host_peak = self._snapshot(self.host_current, self.host_totals)
        else:
            self.totals[record.category] += delta
            self.current += delta
            if self.limit_bytes is not None and delta > 0 and self.current > self.limit_bytes:
                raise HostMemoryExceeded(self.current, self.limit_bytes)
            if self.current > self.peak.total:
                self.peak = self._snapshot(self.current, self.totals)
        self.total_peak = max(self.total_peak, self.current + self.host_current)

    def _snapshot(self, total: int, totals: dict[Category, int]) -> Peak:
        return Peak(total, {c.value: n for c, n in totals.items()}, self.phase, self._stack[-1] if self._stack else "")

    def _forget(self, key: int, _ref: object) -> None:
        with self._lock:
            record = self._records.pop(key, None)
            self._refs.pop(key, None)
            if record is None:
                return
            if record.host:
                self.host_totals[record.category] -= record.nbytes
                self.host_current -= record.nbytes
            else:
                self.totals[record.category] -= record.nbytes
                self.current -= record.nbytes

    def label(self, tensors: Iterable[Optional[torch.Tensor]], category: Category) -> None:
        """Count the storages of ``tensors`` under ``category`` from now on."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                storage, host = _storage(tensor)
                self._track(storage, category, override=True, host=host)

    def comm_buffer(self, tensor: torch.Tensor) -> None:
        """A buffer handed to a collective: scratch made for it becomes a communication buffer."""
        record = self._records.get(id(tensor.untyped_storage()))
        if record is None or record.category in (Category.TEMPORARIES, Category.ACTIVATIONS):
            self._track(tensor.untyped_storage(), Category.COMM_BUFFERS, override=True)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = Peak(self.current, {c.value: n for c, n in self.totals.items()}, self.phase, "")

    @contextlib.contextmanager
    def in_host_memory(self) -> Iterator[None]:
        """Count every storage created in the block as host memory: a model built on the CPU and wrapped there by
        a strategy that offloads it (FSDP with ``cpu_offload`` flattens and shards in host memory)."""
        self._new_on_host = True
        try:
            yield
        finally:
            self._new_on_host = False

    def state_bytes(self) -> int:
        """Device bytes alive now in the categories that stay between steps."""
        return sum(self.totals[c] for c in STATE)

    def host_state_bytes(self) -> int:
        """Host bytes (offloaded state) alive now in the categories that stay between steps."""
        return sum(self.host_totals[c] for c in STATE)

    def name_modules(self, model: nn.Module) -> None:
        """Report peaks inside ``model``'s modules by their qualified names."""
        for name, module in model.named_modules():
            self._names.setdefault(id(module), name or "(root)")

    # ---------------------------------------------------------------- the mode
    def _category_now(self) -> Category:
        if self.phase == "optimizer":
            return Category.OPTIMIZER_STATE
        if self.phase == "backward":
            return Category.TEMPORARIES
        return Category.ACTIVATIONS if self._stack else Category.TEMPORARIES

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is TO_HOST and args[0].device.type == "meta":  # offload in a meta run: host memory, not allocated
            out: Any = host_copy(args[0], args[1] if len(args) > 1 else kwargs.get("dtype"))
        else:
            handled, out = self.meta_data.intercept(func, args, kwargs)
            if not handled:
                out = func(*args, **kwargs)
        self._count_transfer(func, args, out)
        category = self._category_now()
        for tensor in tree_flatten(out)[0]:
            if type(tensor) in _COUNTED:
                try:
                    storage, host = _storage(tensor)
                except (RuntimeError, NotImplementedError):
                    continue
                self._track(storage, category, host=host)
        return out

    def _count_transfer(self, func: Any, args: Any, out: Any) -> None:
        """Bytes crossing between host memory and the device: offloads down, uploads (and copies into) up."""
        if func is TO_HOST and isinstance(out, HostTensor):
            self.transfers["to_host"] += out.nbytes
        elif func.name() == _COPY_TO and isinstance(args[0], HostTensor) and not isinstance(out, HostTensor):
            self.transfers["to_device"] += out.nbytes
        elif func is aten.copy_.default and isinstance(args[0], HostTensor) != isinstance(args[1], HostTensor):
            self.transfers["to_host" if isinstance(args[0], HostTensor) else "to_device"] += args[0].nbytes

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self.label(module.parameters(recurse=False), Category.PARAMETERS)
        self.label(module.buffers(recurse=False), Category.PARAMETERS)
        self._stack.append(self._names.get(id(module), type(module).__name__))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def _resized(self, storage: torch.UntypedStorage) -> None:
        record = self._records.get(id(storage))
        if record is not None:
            with self._lock:
                self._resize(record, storage.nbytes())
        else:
            self._track(storage, self._category_now())

    def __enter__(self) -> Accountant:
        self._unwatch = watch_resizes(self._resized)
        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_forward_pre_hook(self._pre_forward),
            hooks.register_module_forward_hook(self._post_forward, always_call=True),
        ]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._unwatch()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()


__all__ = ["STATE", "Accountant", "Category", "HostMemoryExceeded", "Peak"]
