"""``smp.set_activation_checkpointing``: recompute chosen modules' activations in backward, across a pipeline.

The call only marks the module (before the first step). When the first step partitions the model, each marked
module that lies on one stage gets a checkpointing subclass of its own class (as the pipeline's routing does:
nothing is assigned on the instance, ``isinstance`` and ``state_dict`` are unchanged), built *below* the routing,
so a recomputation runs the module's own forward and never communicates again. The checkpointing itself is
:func:`shardkit.nn.checkpoint.wrapper.checkpointed_call` (RNG replay, normalisation statistics restored, eval and
``no_grad`` forwards plain).

A module whose parts run on different stages cannot be recomputed on one: with auto-partition it runs without
checkpointing and a warning names it (as smp does); with manual partitioning it is an error. For an
``nn.Sequential`` the layers are checkpointed: one by one (``strategy="each"``), or in groups of consecutive
layers (``"contiguous"``: all of them, ``"group_<n>"``: ``n`` at a time) when the whole sequence runs on one
stage; when it spans stages its layers are checkpointed one by one (the same results; groups would keep fewer
boundaries' activations). ``pack_args_as_tuple`` is accepted: the non-reentrant checkpoint passes tuple
inputs through as they are.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
from torch import nn

from shardkit.modelparallel import state as smp_state
from shardkit.nn.checkpoint.flags import is_checkpointing_disabled
from shardkit.nn.checkpoint.wrapper import checkpointed_call

#: Where the request is kept on the module (as ``smp.partition``'s mark is), until the partition applies it.
REQUEST_ATTR = "_smp_activation_checkpointing"
_GROUP = re.compile(r"group_([1-9][0-9]*)")


@dataclass(frozen=True)
class CheckpointRequest:
    """What ``set_activation_checkpointing`` asked for one module."""

    preserve_rng_state: bool = True
    pack_args_as_tuple: bool = False
    strategy: str = "each"

    def group_size(self, layers: int) -> int:
        """How many consecutive layers of a sequence one checkpoint covers."""
        if self.strategy == "each":
            return 1
        if self.strategy == "contiguous":
            return max(layers, 1)
        match = _GROUP.fullmatch(self.strategy)
        assert match is not None
        return int(match.group(1))


def set_activation_checkpointing(
    module: nn.Module, preserve_rng_state: bool = True, pack_args_as_tuple: bool = False, strategy: str = "each"
) -> None:
    """Recompute ``module``'s activations during backward instead of keeping them (call before the first step).

    ``strategy`` (``"each"``, ``"contiguous"``, ``"group_<n>"``) and ``pack_args_as_tuple`` apply to an
    ``nn.Sequential`` only, as in smp.

    Example::

        model = smp.DistributedModel(GPT(cfg))
        for block in model.get_module().blocks:
            smp.set_activation_checkpointing(block)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"smp.set_activation_checkpointing takes an nn.Module, got {type(module).__name__}")
    if strategy not in ("each", "contiguous") and not _GROUP.fullmatch(str(strategy)):
        raise ValueError(f"strategy must be 'each', 'contiguous' or 'group_<n>' (n >= 1), got {strategy!r}")
    if not isinstance(module, nn.Sequential) and (pack_args_as_tuple or strategy != "each"):
        raise ValueError(
            "pack_args_as_tuple and strategy apply to an nn.Sequential only; for another module pass just the module "
            f"(got a {type(module).__name__})"
        )
    model = smp_state.current().model
    if model is not None and model.partitioned:
        raise RuntimeError(
            "smp.set_activation_checkpointing must be called before the first @smp.step call: the partition "
            "applies it below the pipeline's routing of each module"
        )
    module.__dict__[REQUEST_ATTR] = CheckpointRequest(preserve_rng_state, pack_args_as_tuple, strategy)


Swap = tuple[nn.Module, type[nn.Module]]


def plan_checkpointing(root: nn.Module, units: Sequence[str], manual: bool) -> list[Swap]:
    """The class changes that apply every request under ``root``, given the partition's ``units`` (names of the
    largest single-stage subtrees). Raises, or warns and leaves a module out, for one spanning stages."""
    swaps: list[Swap] = []
    for name, module in root.named_modules():
        request = module.__dict__.get(REQUEST_ATTR)
        if request is None:
            continue
        if not isinstance(module, nn.Sequential):
            swaps += _one(name, module, request, units, manual)
            continue
        layers = list(module)
        size = request.group_size(len(layers))
        if size > 1 and _on_one_stage(name, units):
            swaps.append((module, _grouped_class(type(module), size, request)))
            continue
        for child_name, child in module.named_children():
            swaps += _one(f"{name}.{child_name}" if name else child_name, child, request, units, manual)
    return swaps


def _on_one_stage(name: str, units: Sequence[str]) -> bool:
    return any(unit == "" or name == unit or name.startswith(unit + ".") for unit in units)


def _one(name: str, module: nn.Module, request: CheckpointRequest, units: Sequence[str], manual: bool) -> list[Swap]:
    if _on_one_stage(name, units):
        return [(module, _checkpointing_class(type(module), request))]
    message = (
        f"smp.set_activation_checkpointing: module {name!r} has parts on different pipeline stages, and a "
        "checkpointed module is recomputed on one stage"
    )
    if manual:
        raise ValueError(f"{message}: place all of it on one stage with smp.partition, or checkpoint its children")
    warnings.warn(f"{message}; it runs without checkpointing (checkpoint its children instead)", stacklevel=3)
    return []


def _subclass(cls: type[nn.Module], forward: Callable[..., Any]) -> type[nn.Module]:
    return type(
        cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    )


def _checkpointing(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled() and not is_checkpointing_disabled()


def _checkpointing_class(cls: type[nn.Module], request: CheckpointRequest) -> type[nn.Module]:
    original = cls.forward

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not _checkpointing(self):
            return original(self, *args, **kwargs)
        return checkpointed_call(functools.partial(original, self), self, args, kwargs, request.preserve_rng_state)

    return _subclass(cls, forward)


def _grouped_class(cls: type[nn.Module], size: int, request: CheckpointRequest) -> type[nn.Module]:
    original = cls.forward

    def run_layers(layers: list[nn.Module], value: Any) -> Any:
        for layer in layers:
            value = layer(value)
        return value

    @functools.wraps(original)
    def forward(self: nn.Module, value: Any) -> Any:
        if not _checkpointing(self):
            return original(self, value)
        layers = list(cast(nn.Sequential, self))
        for start in range(0, len(layers), size):
            run = functools.partial(run_layers, layers[start : start + size])
            value = checkpointed_call(run, self, (value,), {}, request.preserve_rng_state)
        return value

    return _subclass(cls, forward)
