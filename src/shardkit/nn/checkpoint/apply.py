"""Apply activation checkpointing to every submodule of chosen classes, in place."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Union

from torch import nn

from shardkit.nn.checkpoint.wrapper import CheckpointWrapper, checkpoint_wrapper

ModuleMatch = Callable[[nn.Module], bool]
#: What to checkpoint: one module class, several, or a predicate on the module.
CheckpointTarget = Union[type[nn.Module], Iterable[type[nn.Module]], ModuleMatch]


def module_matcher(target: CheckpointTarget) -> ModuleMatch:
    """Turn a class, a collection of classes or a predicate into a predicate, checking the classes."""
    if isinstance(target, type):
        target = (target,)
    if not isinstance(target, Iterable):
        if callable(target):
            return target
        raise TypeError(f"expected module classes or a callable(module) -> bool, got {type(target).__name__}")
    classes = tuple(target)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad or not classes:
        raise TypeError(
            f"expected one or more nn.Module subclasses (for example your transformer block class), got {bad or '[]'}"
        )
    return lambda module: isinstance(module, classes)


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_on: CheckpointTarget,
    *,
    offload_to_cpu: bool = False,
    descend: Callable[[nn.Module], bool] = lambda module: True,
) -> list[str]:
    """Replace every matching submodule of ``model`` by ``checkpoint_wrapper(submodule)``, in place.

    The outermost match wins: a matched module is wrapped as a whole and its children are not searched.
    ``model`` itself is never wrapped (it cannot be replaced in place); use :func:`checkpoint_wrapper` on it.
    Apply this before sharding the model; modules for which ``descend`` returns ``False`` (for example units
    that are already sharded) are neither wrapped nor searched.

    Args:
        model: the model to modify.
        checkpoint_on: a module class, an iterable of classes, or a predicate ``fn(module) -> bool``.
        offload_to_cpu: passed to :func:`checkpoint_wrapper`.
        descend: predicate deciding whether a submodule is searched at all.

    Returns:
        The qualified names of the wrapped submodules, in traversal order (empty if nothing matched).

    Example::

        names = apply_activation_checkpointing(model, TransformerBlock)
        assert names == ["blocks.0", "blocks.1"]
    """
    matches = module_matcher(checkpoint_on)
    wrapped: list[str] = []

    def visit(parent: nn.Module, parent_name: str) -> None:
        for name, child in list(parent.named_children()):
            qualified = f"{parent_name}{name}"
            if isinstance(child, CheckpointWrapper) or not descend(child):
                continue
            if matches(child):
                setattr(parent, name, checkpoint_wrapper(child, offload_to_cpu=offload_to_cpu))
                wrapped.append(qualified)
            else:
                visit(child, qualified + ".")

    visit(model, "")
    return wrapped
