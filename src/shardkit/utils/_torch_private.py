"""The private torch names that more than one shardkit package uses, imported here and nowhere else.

torch promises nothing about a name that starts with an underscore (or lives in an underscored module). Each such
name shardkit needs is imported once, in the import point of the lowest package that uses it: this module for the
names shared across packages, ``distributed``, ``nn``, ``checkpoint``, ``modelparallel`` and ``plan`` each for
their own (``_torch_private.py`` beside their ``__init__``). Call sites import from there.
``tests/compat/test_torch_private.py`` imports every import point and resolves each name on the running torch, and
scans ``src/`` so no other module reaches a private torch name; ``utils.torch_compat.PRIVATE_APIS`` lists them all
for ``make gpu-check``.

Every name here was checked present on torch 2.8.0, 2.11.0, 2.13.0 and 2.14.1 (CPU and CUDA wheels, 2026-11-27).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# Dispatch modes: the memory tracker, the planner's accountant and smp's trace see every operator through one. If
# they move, those three stop importing; the stack getters only tell whether a mode is already active.
from torch.utils._python_dispatch import TorchDispatchMode, is_in_torch_dispatch_mode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as current_dispatch_mode_stack

# Pytrees: walking the nested containers of a forward's arguments and outputs. If they move, FSDP's input cast and
# output hooks, smp's step, tracing and pipeline, the planner's host tensors and the memory tracker stop importing.
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map, tree_unflatten

#: ``__torch_function__`` of a wrapper subclass (FSDP's placeholders, the planner's host tensors): no Python-level
#: override, so operators reach ``__torch_dispatch__``. If it moves, both classes stop importing.
disabled_torch_function_impl: Any = torch._C._disabled_torch_function_impl


def make_wrapper_subclass(cls: type, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.Tensor._make_wrapper_subclass``: a tensor of class ``cls`` with metadata and no storage of its own.

    If it moves, FSDP's placeholders and the planner's host tensors cannot be built."""
    return torch.Tensor._make_wrapper_subclass(cls, *args, **kwargs)


def current_graph_task_id() -> int:
    """The id of the backward pass autograd's engine runs on this thread, -1 outside one.

    torch's own FSDP2 and module tracker read it the same way; if it moves, ``utils.autograd.backward_running``
    (FSDP's and the memory tracker's inside-backward test) fails at its first call."""
    return int(torch._C._current_graph_task_id())


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished (autograd engine's ``queue_callback``).

    The end-of-backward hook of FSDP, ShardedDataParallel and SlowMo; if it moves, their first backward fails. The
    engine is looked up at each call, as before, so a test may replace it."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def dtensor_local_tensor(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The rank's local shard a ``DTensor`` wraps (its ``_local_tensor``), or None for any other tensor.

    The memory tracker counts a DTensor parameter (torch FSDP2) by its shard's storage; if the attribute moves, it
    counts the wrapper instead (no storage: the shard goes uncounted), which the compat test catches first."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else None


# torch.amp.GradScaler keeps its state in private attributes; shardkit's three scalers (fairscale's GradScaler and
# ShardedGradScaler, smp's GradScaler) subclass it and read them through these. If they move, the first unscale_ (or
# the first scale() of a scaler whose device is inferred) fails with an AttributeError.


def scaler_scale(scaler: torch.amp.GradScaler) -> Optional[torch.Tensor]:
    """The scaler's scale tensor (``_scale``), None until its first ``scale()``."""
    return scaler._scale


def set_scaler_device(scaler: torch.amp.GradScaler, device_type: str) -> None:
    """Set the device type the scaler creates its scale on (``_device``); only before its first ``scale()``."""
    scaler._device = device_type


def scaler_optimizer_state(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The scaler's per-optimizer record (``_per_optimizer_states[id(optimizer)]``): its stage and its
    ``found_inf_per_device`` flags, which ``step`` reads."""
    return scaler._per_optimizer_states[id(optimizer)]


# torch.optim.Optimizer keeps the hooks registered with register_state_dict_pre_hook / _post_hook and
# register_load_state_dict_post_hook in private dicts; OSS, which writes its own state_dict and load_state_dict, runs
# them through these. If they move, OSS's state_dict() fails with an AttributeError.


def optimizer_state_dict_pre_hooks(optimizer: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The hooks ``optimizer.state_dict()`` runs first, in registration order."""
    return list(optimizer._optimizer_state_dict_pre_hooks.values())


def optimizer_state_dict_post_hooks(optimizer: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The hooks ``optimizer.state_dict()`` runs on the dict it built, in registration order."""
    return list(optimizer._optimizer_state_dict_post_hooks.values())


def optimizer_load_state_dict_post_hooks(optimizer: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The hooks ``optimizer.load_state_dict()`` runs last, in registration order."""
    return list(optimizer._optimizer_load_state_dict_post_hooks.values())


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch's learning-rate schedulers that ``optimizer`` has stepped (the ``_opt_called`` flag
    ``LRScheduler.step`` reads to warn about a scheduler stepped before its optimizer).

    Lightning's sharded strategy replaces the optimizer the schedulers hold by an OSS one; if the flag moves, they
    warn once, wrongly, and nothing else changes."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def cuda_sleep(cycles: int) -> None:
    """``torch.cuda._sleep``: keep the current CUDA stream busy for about ``cycles`` GPU clock cycles.

    Only ``make gpu-check``'s race amplifier uses it; if it moves, that check fails, nothing in training."""
    torch.cuda._sleep(cycles)


__all__ = [
    "TorchDispatchMode",
    "TreeSpec",
    "cuda_sleep",
    "current_dispatch_mode_stack",
    "current_graph_task_id",
    "disabled_torch_function_impl",
    "dtensor_local_tensor",
    "is_in_torch_dispatch_mode",
    "make_wrapper_subclass",
    "mark_optimizer_stepped",
    "optimizer_load_state_dict_post_hooks",
    "optimizer_state_dict_post_hooks",
    "optimizer_state_dict_pre_hooks",
    "queue_autograd_callback",
    "scaler_optimizer_state",
    "scaler_scale",
    "set_scaler_device",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
]
