"""Live bytes by category while one planned rank runs, on meta tensors as on real ones.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every operator's outputs. Each new storage is
counted (in a :class:`~shardkit.memory.StorageBook`, the memory tracker's bookkeeping) once (however many views it
has), by its size now, under a category chosen from *when* it appeared (optimizer step → optimizer state, backward →
temporaries, inside a module's forward → activations, else temporaries) and re-labelled once its role is known: a
module's parameters and buffers when its forward starts and at every phase boundary, ``.grad`` as soon as autograd
accumulates it, optimizer state after the step, and buffers handed to a collective → communication buffers. A weak
reference per storage takes its bytes off when torch frees it; ``UntypedStorage.resize_`` (how FSDP frees full
parameters) is followed too.

Host memory (what a strategy offloads to the CPU: :class:`~shardkit.plan.host.HostTensor` objects) has a second
book, with its own peak; :attr:`Accountant.transfers` counts the bytes copied between the two.
The same mode answers data reads from meta tensors (:class:`~shardkit.plan.oracle.MetaData`) and the
``shardkit::to_host`` operator (:mod:`shardkit.plan.host`), so one mode is on the stack.
Planning runs on meta or CPU tensors only, where autograd runs backward on the calling thread, so the
thread-local mode sees backward too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from shardkit.memory import Category, MemoryLimitExceeded, StorageBook
from shardkit.memory.offload import TO_HOST
from shardkit.memory.resize_watch import watch_resizes
from shardkit.plan.host import HostTensor, host_copy
from shardkit.plan.oracle import COPY_TO, MetaData
from shardkit.utils._torch_private import TorchDispatchMode, tree_flatten

aten = torch.ops.aten


#: The categories that stay between steps.
STATE = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)

#: A real CPU run needed more host memory than the planner may use (raised by the device book's limit).
HostMemoryExceeded = MemoryLimitExceeded


@dataclass
class Peak:
    """The highest total seen, by category, with where the step was."""

    total: int = 0
    by_category: dict[str, int] = field(default_factory=dict)
    phase: str = ""
    module: str = ""


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
        self.meta_data = MetaData()
        #: Device memory; ``limit_bytes`` bounds it for runs on real CPU tensors.
        self.device = StorageBook(limit_bytes, functools.partial(self._note_peak, "device"))
        #: Host memory: what a strategy offloads (never allocated in a meta run).
        self.host = StorageBook(on_peak=functools.partial(self._note_peak, "host"))
        self.peak = Peak()
        self.host_peak = Peak()
        #: The peak of device and host memory together.
        self.total_peak = 0
        #: Bytes copied so far into host memory (``"to_host"``) and back onto the device (``"to_device"``).
        self.transfers: dict[str, int] = {"to_host": 0, "to_device": 0}
        #: Count new storages as host memory (set by :meth:`in_host_memory`).
        self._new_on_host = False
        #: FLOPs of the operators run while :attr:`count_flops` is set (torch's per-operator formulas).
        self.count_flops = False
        self.flops = 0.0
        self.phase = "setup"
        self._stack: list[str] = []
        self._names: dict[int, str] = {}
        self._unwatch: Callable[[], None] = lambda: None
        self._handles: list[Any] = []

    # ---------------------------------------------------------------- bookkeeping
    @property
    def current(self) -> int:
        """Device bytes alive now."""
        return self.device.current

    @property
    def host_current(self) -> int:
        """Host bytes alive now."""
        return self.host.current

    def _note_peak(self, which: str) -> None:
        book = self.device if which == "device" else self.host
        peak = Peak(
            book.peak,
            {c.value: n for c, n in book.peak_snapshot().by_category.items()},
            self.phase,
            self._stack[-1] if self._stack else "",
        )
        if which == "device":
            self.peak = peak
        else:
            self.host_peak = peak

    def _track(
        self, storage: torch.UntypedStorage, category: Category, override: bool = False, host: bool = False
    ) -> None:
        """Count ``storage`` in the book that holds it already, else in the host book for host tensors (and
        everything made inside :meth:`in_host_memory`), else in the device book."""
        if self.host.category_of(storage) is not None or (
            self.device.category_of(storage) is None and (host or self._new_on_host)
        ):
            self.host.track(storage, category, override)
        else:
            self.device.track(storage, category, override)
        self.total_peak = max(self.total_peak, self.device.current + self.host.current)

    def label(self, tensors: Iterable[Optional[torch.Tensor]], category: Category) -> None:
        """Count the storages of ``tensors`` under ``category`` from now on."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                storage, host = _storage(tensor)
                self._track(storage, category, override=True, host=host)

    def comm_buffer(self, tensor: torch.Tensor) -> None:
        """A buffer handed to a collective: scratch made for it becomes a communication buffer."""
        storage = tensor.untyped_storage()
        if self.device.category_of(storage) in (None, Category.TEMPORARIES, Category.ACTIVATIONS):
            self._track(storage, Category.COMM_BUFFERS, override=True)

    @contextlib.contextmanager
    def in_host_memory(self) -> Iterator[None]:
        """Count every storage created in the block as host memory: a model built on the CPU and wrapped there by
        a strategy that offloads it (FSDP with ``cpu_offload`` flattens and shards in host memory)."""
        self._new_on_host = True
        try:
            yield
        finally:
            self._new_on_host = False

    def move_to_device(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the (host-booked) storages of ``tensors`` as device memory from now on: a wrapped model's state
        moved onto the device (``model.to(device)`` after wrapping on the CPU)."""
        for tensor in tensors:
            storage, host = _storage(tensor)
            if host:
                continue  # a real host tensor (offloaded state) stays where it is
            category = self.host.drop(storage)
            if category is not None:
                self.device.track(storage, category)
        self.total_peak = max(self.total_peak, self.device.current + self.host.current)

    def state_bytes(self) -> int:
        """Device bytes alive now in the categories that stay between steps."""
        return sum(self.device.total(c) for c in STATE)

    def host_state_bytes(self) -> int:
        """Host bytes (offloaded state) alive now in the categories that stay between steps."""
        return sum(self.host.total(c) for c in STATE)

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
        if self.count_flops:
            formula = flop_registry.get(func.overloadpacket)
            if formula is not None:
                self.flops += formula(*args, **kwargs, out_val=out)
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
        elif func.name() == COPY_TO and isinstance(args[0], HostTensor) and not isinstance(out, HostTensor):
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
        book = self.host if self.host.category_of(storage) is not None else self.device
        book.resized(storage, self._category_now())
        self.total_peak = max(self.total_peak, self.device.current + self.host.current)

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
