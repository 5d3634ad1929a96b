"""Which modules become distributed: smp's registrations (``smp.tp_register``) and marks
(``smp.tensor_parallelism()``, ``smp.set_tensor_parallelism()``).

A registration pairs a module class with an ``smp.nn`` distributed module and smp's three hooks: ``init_hook`` maps
the original constructor's arguments to the distributed module's, ``forward_hook`` its forward arguments, and
``return_hook`` the distributed module's output back to what the original returned. smp's contract hands
``init_hook`` the arguments the original was constructed with, which exist only inside its ``__init__``: so a
registered class records them (once per class, on the instances it creates), with the context it was created in.
``nn.Linear`` is registered to
:class:`~shardkit.modelparallel.tp.layers.DistributedLinear` from the start, taking the original's weights.

Marks say which modules to distribute. ``tensor_parallelism()`` marks every module created inside it (seen through
torch's global registration hooks for parameters and submodules, so no constructor is patched for it); the innermost
context wins. ``set_tensor_parallelism(module, enabled)`` marks a subtree after creation. Both only record: the
modules are replaced when ``smp.DistributedModel`` wraps the model (see :mod:`~.distribute`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

Hook = Optional[Callable[..., Any]]


@dataclass(frozen=True)
class Registration:
    """A module class's distributed counterpart and smp's hooks (see the module docstring)."""

    dist_module: type[nn.Module]
    init_hook: Hook = None
    forward_hook: Hook = None
    return_hook: Hook = None


@dataclass(frozen=True)
class Mark:
    """Whether a module (and the modules below it that carry no mark of their own) is to be distributed, and the
    keyword arguments that override the distributed module's constructor arguments."""

    enabled: bool
    overrides: dict[str, Any] = field(default_factory=dict)


class _Registry:
    """The process's registrations (smp's are process-wide too) and marks (weak: a dropped model takes its own)."""

    def __init__(self) -> None:
        self.by_class: dict[type[nn.Module], Registration] = {}
        self.marks: weakref.WeakKeyDictionary[nn.Module, Mark] = weakref.WeakKeyDictionary()
        self.init_args: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], dict[str, Any]]] = (
            weakref.WeakKeyDictionary()
        )
        #: classes whose own ``__init__`` records its arguments (wrapped once, at their first registration)
        self.recording: set[type[nn.Module]] = set()


REGISTRY = _Registry()
_CONTEXT: contextvars.ContextVar[Optional[Mark]] = contextvars.ContextVar("smp_tensor_parallelism", default=None)


def registration_for(module: nn.Module) -> Optional[Registration]:
    """The registration of ``module``'s class (the nearest registered base class), if any."""
    for cls in type(module).__mro__:
        found = REGISTRY.by_class.get(cls)
        if found is not None:
            return found
    return None


def register(module_cls: type[nn.Module], registration: Registration) -> None:
    """Register ``module_cls`` (recording its instances' constructor arguments from now on)."""
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise TypeError(f"smp.tp_register_with_module: module_cls must be an nn.Module class, got {module_cls!r}")
    if not (isinstance(registration.dist_module, type) and issubclass(registration.dist_module, nn.Module)):
        raise TypeError(
            f"smp.tp_register: dist_module must be an smp.nn distributed module class, got {registration.dist_module!r}"
        )
    REGISTRY.by_class[module_cls] = registration
    if module_cls not in REGISTRY.recording:
        _record_init_args(module_cls)


def _record_init_args(module_cls: type[nn.Module]) -> None:
    original = module_cls.__init__

    @functools.wraps(original)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        mark = _CONTEXT.get()  # the context the instance is created in (its children's hooks see inner ones)
        original(self, *args, **kwargs)
        REGISTRY.init_args.setdefault(self, (args, kwargs))
        if mark is not None and self not in REGISTRY.marks:
            REGISTRY.marks[self] = mark

    module_cls.__init__ = __init__  # type: ignore[method-assign]
    REGISTRY.recording.add(module_cls)


def init_args(module: nn.Module) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The arguments ``module`` was constructed with, when its class was registered before it was created."""
    return REGISTRY.init_args.get(module)


def mark_of(module: nn.Module) -> Optional[Mark]:
    """The mark set on ``module`` itself, if any."""
    return REGISTRY.marks.get(module)


def _on_created(module: nn.Module, *_: Any) -> None:
    mark = _CONTEXT.get()
    if mark is not None and module not in REGISTRY.marks:
        REGISTRY.marks[module] = mark


def _on_child(module: nn.Module, name: str, child: Optional[nn.Module]) -> None:
    # Only the child: a parent assigning one child inside the context (smp's own example) is not marked itself.
    if child is not None:
        _on_created(child)


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **tp_config: Any) -> Iterator[None]:
    """Mark the modules created inside for tensor parallelism (``enabled=False``: keep them unsplit); the innermost
    context wins. ``tp_config`` overrides arguments of the distributed modules that replace them. The modules are
    replaced when ``smp.DistributedModel`` wraps the model; those that cannot be split are listed once in the log.

    Example::

        with smp.tensor_parallelism():
            self.m0 = nn.Linear(20, 20)                   # distributed
            with smp.tensor_parallelism(enabled=False):
                self.m1 = nn.Linear(20, 20)               # not distributed
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"smp.tensor_parallelism(enabled=...) takes True or False, got {enabled!r}")
    token = _CONTEXT.set(Mark(enabled, dict(tp_config)))
    params = register_module_parameter_registration_hook(_on_created)
    children = register_module_module_registration_hook(_on_child)
    try:
        yield
    finally:
        params.remove()
        children.remove()
        _CONTEXT.reset(token)


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **tp_config: Any) -> None:
    """Mark ``module`` (and every module below it without a mark of its own, unless disabling: then the whole
    subtree) for tensor parallelism, after creation and before ``smp.DistributedModel`` wraps the model."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"smp.set_tensor_parallelism takes an nn.Module, got {type(module).__name__}")
    REGISTRY.marks[module] = Mark(bool(enabled), dict(tp_config))
    if not enabled:
        for sub in module.modules():
            REGISTRY.marks[sub] = Mark(False)


def tp_register(
    dist_module: type[nn.Module], init_hook: Hook = None, forward_hook: Hook = None, return_hook: Hook = None
) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """smp's class decorator registering ``dist_module`` as the distributed version of the decorated class.

    Example::

        @smp.tp_register(smp.nn.DistributedTransformer, init_hook=lambda config: ((), config.to_dict()))
        class MyTransformer(nn.Module):
            ...
    """

    def decorate(module_cls: type[nn.Module]) -> type[nn.Module]:
        register(module_cls, Registration(dist_module, init_hook, forward_hook, return_hook))
        return module_cls

    return decorate


def tp_register_with_module(
    module_cls: type[nn.Module],
    dist_module: type[nn.Module],
    init_hook: Hook = None,
    forward_hook: Hook = None,
    return_hook: Hook = None,
) -> None:
    """smp's registration of ``dist_module`` as the distributed version of an existing class ``module_cls``
    (instances created from now on can be distributed)."""
    register(module_cls, Registration(dist_module, init_hook, forward_hook, return_hook))
