"""Manual partitioning: ``with smp.partition(i):`` marks the modules created inside it for pipeline stage ``i``;
``smp.set_partition(module, i)`` marks a module already built, and its descendants that have no mark of their own.

A module counts as created inside a context when it is registered as a submodule there, or registers its own
parameters or buffers there (so layers built inside a context and collected into an ``nn.ModuleList`` outside
it keep their stage). The first mark wins, so the innermost context around a module's creation decides. The
marks are recorded by torch's global registration hooks, installed only while a context is open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Optional

from torch import nn
from torch.nn.modules import module as module_hooks

from shardkit.modelparallel import state as smp_state

#: Attribute holding a module's manual partition index.
PARTITION_ATTR = "_smp_partition"
#: Set beside it by ``smp.set_partition``: the index then also holds for the module's unmarked descendants.
INHERITED_ATTR = "_smp_partition_inherited"

_STACK: ContextVar[tuple[int, ...]] = ContextVar("shardkit_smp_partition_stack", default=())


def _check_index(index: int) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"smp.partition(index) needs a partition index >= 0, got {index!r}")
    if smp_state.is_initialized():
        config = smp_state.current().config
        if index >= config.chunks:
            virtual = f" x virtual_stages={config.virtual_stages}" if config.virtual_stages > 1 else ""
            raise ValueError(
                f"smp.partition({index}) is out of range: the config has partitions={config.partitions}{virtual}, "
                f"so valid indices are 0..{config.chunks - 1}"
            )


def _mark(module: Optional[nn.Module]) -> None:
    stack = _STACK.get()
    if module is not None and stack and PARTITION_ATTR not in module.__dict__:
        module.__dict__[PARTITION_ATTR] = stack[-1]


def _on_submodule(parent: nn.Module, name: str, submodule: Optional[nn.Module]) -> None:
    _mark(submodule)


def _on_tensor(module: nn.Module, name: str, tensor: Any) -> None:
    _mark(module)


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Place every module created inside the block on pipeline stage ``index`` (innermost context wins).

    Used inside a module's ``__init__``; ignored when ``auto_partition`` is on. Modules created outside every
    context go to ``default_partition``.

    Example::

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                with smp.partition(0):
                    self.encoder = Encoder()
                with smp.partition(1):
                    self.decoder = Decoder()
    """
    _check_index(index)
    stack = _STACK.get()
    token = _STACK.set((*stack, index))
    handles = []
    if not stack:
        handles = [
            module_hooks.register_module_module_registration_hook(_on_submodule),
            module_hooks.register_module_parameter_registration_hook(_on_tensor),
            module_hooks.register_module_buffer_registration_hook(_on_tensor),
        ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        _STACK.reset(token)


def set_partition(module: nn.Module, index: int) -> None:
    """Place ``module`` on pipeline stage ``index`` (smp v1.6+), and with it every descendant that no
    ``smp.partition`` context or ``set_partition`` call placed itself. The last call on a module wins.

    Call it before the first step (the partition is decided there); ignored when ``auto_partition`` is on.

    Example::

        model = smp.DistributedModel(model)
        for i, block in enumerate(model.get_module().transformer.h):
            smp.set_partition(block, i * smp.pp_size() // len(model.get_module().transformer.h))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"smp.set_partition(module, index) takes a torch.nn.Module, got {type(module).__name__}")
    _check_index(index)
    if smp_state.is_initialized():
        model = smp_state.current().model
        if model is not None and model.partitioned:
            raise RuntimeError(
                "smp.set_partition was called after the first step partitioned the model: call it before the first "
                "step (right after smp.DistributedModel(...))"
            )
    module.__dict__[PARTITION_ATTR] = index
    module.__dict__[INHERITED_ATTR] = True


def manual_index(module: nn.Module) -> Optional[int]:
    """The partition index a ``smp.partition`` context gave ``module``, or None."""
    value = module.__dict__.get(PARTITION_ATTR)
    return int(value) if value is not None else None


def manual_assignment(root: nn.Module, partitions: int, default_partition: int) -> dict[str, int]:
    """The stage of every module of ``root`` by name: its ``smp.partition`` mark, else ``default_partition``.

    Raises when a mark is not below ``partitions`` (a context entered before ``smp.init`` is checked here).
    """
    assignment: dict[str, int] = {}
    inherited: dict[str, int] = {}  # set_partition marks, by module name, for the descendants without one
    for name, module in root.named_modules():
        index = manual_index(module)
        parent = name.rpartition(".")[0] if name else None
        if index is None and parent is not None and parent in inherited:
            index = inherited[parent]
        if index is not None and (module.__dict__.get(INHERITED_ATTR) or (parent is not None and parent in inherited)):
            inherited[name] = index
        if index is not None and index >= partitions:
            raise ValueError(
                f"module {name or '<root>'!r} was created inside smp.partition({index}), but the config has "
                f"partitions={partitions}: use an index in 0..{partitions - 1}"
            )
        assignment[name] = default_partition if index is None else index
    return assignment
