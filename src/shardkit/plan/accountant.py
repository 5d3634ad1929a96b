"""Live bytes by category while one planned rank runs, on meta tensors as on real ones.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every operator's outputs. Each new storage is
counted once (however many views it has), by its size now, under a category chosen from *when* it appeared
(optimizer step → optimizer state, backward → temporaries, inside a module's forward → activations, else
temporaries) and re-labelled once its role is known: a module's parameters and buffers when its forward starts
and at every phase boundary, ``.grad`` as soon as autograd accumulates it, optimizer state after the step, and
buffers handed to a collective → communication buffers. A weak reference per storage takes its bytes off when
torch frees it; ``UntypedStorage.resize_`` (how FSDP frees full parameters) is followed too.

The same mode answers data reads from meta tensors (:class:`~shardkit.plan.oracle.MetaData`), so one mode is on
the stack. Planning runs on meta or CPU tensors only, where autograd runs backward on the calling thread, so the
thread-local mode sees backward too.
"""

from __future__ import annotations

import enum
import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardkit.memory.resize_watch import watch_resizes
from shardkit.plan.oracle import MetaData


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
    __slots__ = ("category", "nbytes")

    def __init__(self, category: Category, nbytes: int) -> None:
        self.category = category
        self.nbytes = nbytes


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
        self.phase = "setup"
        self._stack: list[str] = []
        self._names: dict[int, str] = {}
        # Re-entrant: a weakref callback (a storage freed by a garbage collection that a dict insert or
        # weakref.ref() under the lock happens to trigger) takes the lock again on the same thread.
        self._lock = threading.RLock()
        self._unwatch: Callable[[], None] = lambda: None
        self._handles: list[Any] = []

    # ---------------------------------------------------------------- bookkeeping
    def _track(self, storage: torch.UntypedStorage, category: Category, override: bool = False) -> None:
        key = id(storage)
        with self._lock:
            record = self._records.get(key)
            if record is None:
                record = _Record(category, 0)
                self._records[key] = record
                self._refs[key] = weakref.ref(storage, functools.partial(self._forget, key))
            elif override and record.category != category:
                self.totals[record.category] -= record.nbytes
                self.totals[category] += record.nbytes
                record.category = category
            self._resize(record, storage.nbytes())

    def _resize(self, record: _Record, nbytes: int) -> None:
        delta = nbytes - record.nbytes
        if not delta:
            return
        record.nbytes = nbytes
        self.totals[record.category] += delta
        self.current += delta
        if self.limit_bytes is not None and delta > 0 and self.current > self.limit_bytes:
            raise HostMemoryExceeded(self.current, self.limit_bytes)
        if self.current > self.peak.total:
            self.peak = Peak(
                self.current,
                {c.value: n for c, n in self.totals.items()},
                self.phase,
                self._stack[-1] if self._stack else "",
            )

    def _forget(self, key: int, _ref: object) -> None:
        with self._lock:
            record = self._records.pop(key, None)
            self._refs.pop(key, None)
            if record is not None:
                self.totals[record.category] -= record.nbytes
                self.current -= record.nbytes

    def label(self, tensors: Iterable[Optional[torch.Tensor]], category: Category) -> None:
        """Count the storages of ``tensors`` under ``category`` from now on."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor.untyped_storage(), category, override=True)

    def comm_buffer(self, tensor: torch.Tensor) -> None:
        """A buffer handed to a collective: scratch made for it becomes a communication buffer."""
        record = self._records.get(id(tensor.untyped_storage()))
        if record is None or record.category in (Category.TEMPORARIES, Category.ACTIVATIONS):
            self._track(tensor.untyped_storage(), Category.COMM_BUFFERS, override=True)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = Peak(self.current, {c.value: n for c, n in self.totals.items()}, self.phase, "")

    def state_bytes(self) -> int:
        """Bytes alive now in the categories that stay between steps."""
        return sum(self.totals[c] for c in STATE)

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
        handled, out = self.meta_data.intercept(func, args, kwargs)
        if not handled:
            out = func(*args, **kwargs)
        category = self._category_now()
        for tensor in tree_flatten(out)[0]:
            if type(tensor) in (torch.Tensor, nn.Parameter):
                try:
                    storage = tensor.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                self._track(storage, category)
        return out

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
