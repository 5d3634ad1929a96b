"""Optimizers built in an order that cannot train: refused before they silently do nothing.

``opt = AdamW(model.parameters()); model = FSDP(model)`` is the order DDP users are used to, but FSDP replaces the
model's parameters by flat shards, so ``opt`` holds parameters nothing uses any more: training runs, the loss
prints, and the model never changes. FSDP marks every parameter it replaces (:func:`remember_replaced`), and one
optimizer step pre-hook (:func:`install_step_check`, installed by the first FSDP) refuses the first ``step()`` of
any optimizer holding such a parameter, on every rank (every rank built its optimizer the same way), before it
changes anything. It checks each optimizer once per set of param groups, so later steps cost one dictionary look-up.

``ShardedDataParallel(model, OSS(other.parameters()))``, with an optimizer over another copy of the model, would
also train nothing: :func:`check_optimizers_hold_model` refuses it at construction.

``optimizer.step()`` inside ``model.no_sync()`` (gradient accumulation with the step indented one level too deep)
steps on gradients no rank has reduced yet: FSDP's step leaves the model unchanged (the sums wait outside the
shards until the next synced backward), ShardedDataParallel's owners step with their own rank's gradients only and
broadcast the result. :func:`refuse_steps_inside` marks the wrapper's parameters while its block is open, and the
same step pre-hook refuses a step of an optimizer holding one, on every rank, before anything changes. Outside any
such block the check costs one integer comparison per step.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

#: Attribute FSDP sets on each parameter it replaced by a flat shard: where that parameter was.
REPLACED_ATTR = "_shardkit_replaced_by_fsdp"
#: Attribute set on a wrapper's parameters while its ``no_sync()`` block is open: the block's name.
NO_SYNC_ATTR = "_shardkit_in_no_sync"


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
def _open_no_sync_blocks() -> list[int]:
    """How many ``no_sync()`` blocks are open in this process (one counter, made once)."""
    return [0]


def _check_no_sync(optimizer: Optimizer) -> None:
    inside = {getattr(p, NO_SYNC_ATTR) for g in optimizer.param_groups for p in g["params"] if hasattr(p, NO_SYNC_ATTR)}
    if inside:
        who = sorted(inside)[0]
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() was called inside {who}.no_sync(): the gradients of the backward "
            "passes in that block are not reduced across ranks yet, so this step would not train on them (FSDP "
            "would leave the model unchanged; ShardedDataParallel would step each owner's shard with its own "
            "rank's gradients only). Step after a backward outside the block:\n"
            "    with model.no_sync():\n        loss_fn(model(x0), y0).backward()\n"
            "    loss_fn(model(x1), y1).backward()  # reduces the sum\n    optimizer.step()"
        )


@contextlib.contextmanager
def refuse_steps_inside(params: Iterable[torch.Tensor], block: str) -> Iterator[None]:
    """While open, an optimizer step over any of ``params`` raises, naming ``block`` (e.g.
    ``"FullyShardedDataParallel"``): gradients accumulated in a ``no_sync()`` block are not reduced yet."""
    install_step_check()
    marked = [p for p in params if not hasattr(p, NO_SYNC_ATTR)]  # an outer block's marks stay
    for p in marked:
        setattr(p, NO_SYNC_ATTR, block)
    blocks = _open_no_sync_blocks()
    blocks[0] += 1
    try:
        yield
    finally:
        blocks[0] -= 1
        for p in marked:
            delattr(p, NO_SYNC_ATTR)


@functools.cache
def install_step_check() -> None:
    """Install (once per process) the optimizer step pre-hook that refuses optimizers holding replaced parameters,
    and steps inside a ``no_sync()`` block."""
    checked: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()
    blocks = _open_no_sync_blocks()

    def pre_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        _check_step(optimizer, checked)
        if blocks[0]:
            _check_no_sync(optimizer)

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
