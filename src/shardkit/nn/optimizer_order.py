"""Optimizers built in an order that cannot train: refused before they silently do nothing.

``opt = AdamW(model.parameters()); model = FSDP(model)`` is the order DDP users are used to, but FSDP replaces the
model's parameters by flat shards, so ``opt`` holds parameters nothing uses any more: training runs, the loss
prints, and the model never changes. FSDP marks every parameter it replaces (:func:`remember_replaced`), and one
optimizer step pre-hook (:func:`install_step_check`, installed by the first FSDP) refuses the first ``step()`` of
any optimizer holding such a parameter, on every rank (every rank built its optimizer the same way), before it
changes anything. It checks each optimizer once per set of param groups, so later steps cost one dictionary look-up.

``ShardedDataParallel(model, OSS(other.parameters()))``, with an optimizer over another copy of the model, would
also train nothing: :func:`check_optimizers_hold_model` refuses it at construction.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

#: Attribute FSDP sets on each parameter it replaced by a flat shard: where that parameter was.
REPLACED_ATTR = "_shardkit_replaced_by_fsdp"


def parameters_by_id(module: nn.Module) -> dict[int, tuple[str, nn.Parameter]]:
    """``module``'s parameters (by id) with their names: what FSDP is about to flatten."""
    return {id(p): (name, p) for name, p in module.named_parameters(remove_duplicate=False)}


def remember_replaced(before: dict[int, tuple[str, nn.Parameter]], module: nn.Module, unit: str) -> None:
    """Mark the parameters of ``before`` that ``module`` no longer holds (FSDP replaced them by shards)."""
    now = {id(p) for p in module.parameters()}
    for key, (name, param) in before.items():
        if key not in now:
            setattr(param, REPLACED_ATTR, f"{name!r} of FullyShardedDataParallel unit {unit!r}")
    install_step_check()


def _replaced_in(param_groups: Iterable[dict[str, Any]]) -> list[str]:
    return [getattr(p, REPLACED_ATTR) for group in param_groups for p in group["params"] if hasattr(p, REPLACED_ATTR)]


def _check_step(optimizer: Optimizer, checked: weakref.WeakKeyDictionary[Optimizer, int]) -> None:
    signature = sum(len(group["params"]) for group in optimizer.param_groups)
    if checked.get(optimizer) == signature:
        return
    replaced = _replaced_in(optimizer.param_groups)
    if replaced:
        name = type(optimizer).__name__
        shown = ", ".join(replaced[:3]) + (f" and {len(replaced) - 3} more" if len(replaced) > 3 else "")
        raise RuntimeError(
            f"{name} was built before the model was wrapped in FullyShardedDataParallel: it holds parameters FSDP "
            f"replaced by flat shards ({shown}), so its step() would never change the model. Build the optimizer "
            f"after wrapping: `model = FullyShardedDataParallel(model)`, then `optimizer = {name}(model.parameters(), "
            "...)`."
        )
    checked[optimizer] = signature


@functools.cache
def install_step_check() -> None:
    """Install (once per process) the optimizer step pre-hook that refuses optimizers holding replaced parameters."""
    checked: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()

    def pre_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        _check_step(optimizer, checked)

    register_optimizer_step_pre_hook(pre_step)


def check_optimizers_hold_model(module: nn.Module, held: Iterable[torch.Tensor]) -> None:
    """Refuse sharded optimizers holding parameters that ``module`` does not have (built over another model)."""
    own = {id(p) for p in module.parameters()}
    foreign = [p for p in held if id(p) not in own]
    if foreign:
        shapes = ", ".join(str(list(p.shape)) for p in foreign[:3])
        raise ValueError(
            f"the OSS optimizer holds {len(foreign)} parameter(s) (shapes {shapes}) that the module given to "
            "ShardedDataParallel does not have: it was built over another model (a copy, or the model before it "
            "was replaced), so its step() would never change this one. Build it over this module: "
            "`optimizer = OSS(model.parameters(), ...)`, then `ShardedDataParallel(model, optimizer)`."
        )
