"""Full parameters on demand: what a :class:`~shardkit.nn.fsdp.FullyShardedDataParallel` hands
``summon_full_params``, ``apply`` and ``reset_parameters`` to.

The functions work on a :class:`~shardkit.nn.fsdp.unit_module.UnitModule` (its run-time units, group and
settings), never on the public class, so the public class imports them and not the other way round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

from torch import nn

from shardkit.nn.fsdp.collective_calls import every_rank_calls
from shardkit.nn.fsdp.runtime import TrainingState
from shardkit.nn.fsdp.unit_module import UnitModule


@contextlib.contextmanager
def summon(
    owner: UnitModule, recurse: bool = True, volatile: bool = False, writeback: Optional[bool] = None
) -> Iterator[None]:
    """Full parameters of ``owner`` (with ``recurse``, and of its nested units) under their original names inside
    the block; unless ``volatile`` (or ``writeback=False``), written back to the shards on exit. Not allowed inside
    forward or backward; every rank enters the block. Example (what ``model.summon_full_params()`` runs)::

        with summon(model):
            model.module.fc.weight.mul_(0.5)
    """
    if writeback is None:
        writeback = not volatile
    elif writeback and volatile:
        raise ValueError(
            "summon_full_params(volatile=True, writeback=True) contradict each other: volatile=True means no "
            "writeback; pass only one of them"
        )
    if owner.training_state != TrainingState.SUMMON_FULL_PARAMS:
        every_rank_calls(owner.process_group, "summon_full_params()")
    entered = []
    try:
        for unit in owner.fsdp_units(recurse):
            if unit.state == TrainingState.SUMMON_FULL_PARAMS:
                continue  # already summoned by an enclosing call
            unit.transition("summon")
            entered.append(unit)
            unit.group.summon()
        yield
    finally:
        for unit in reversed(entered):
            if unit.group.is_summoned():
                unit.group.unsummon(writeback)
            unit.transition("unsummon")


def apply(owner: UnitModule, fn: Callable[[nn.Module], None]) -> None:
    """``nn.Module.apply(fn)`` over ``owner`` with full parameters, written back to the shards."""
    if owner.training_state == TrainingState.SUMMON_FULL_PARAMS:
        nn.Module.apply(owner, fn)
        return
    with summon(owner, recurse=True, writeback=True):
        nn.Module.apply(owner, fn)


def reset(owner: UnitModule) -> None:
    """``reset_parameters()`` of the wrapped module on its full parameters, only when ``owner`` allows it
    (re-initialising after sharding gives different values than before wrapping: random streams differ)."""
    if not owner.allow_reset_parameters:
        raise RuntimeError(
            "reset_parameters() after FullyShardedDataParallel wrapping is not allowed: initialise the module "
            "before wrapping, or pass allow_reset_parameters=True"
        )
    with summon(owner, recurse=True):
        module: Any = owner.wrapped_module  # any module class may define reset_parameters
        module.reset_parameters()
