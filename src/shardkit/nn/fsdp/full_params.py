"""Full parameters on demand: the ``summon_full_params`` and ``reset_parameters`` methods of
:class:`~shardkit.nn.fsdp.FullyShardedDataParallel`, as a base class it inherits.

Built on :class:`~shardkit.nn.fsdp.unit_module.UnitModule` (a unit's state and settings), so users call them on
the FSDP object and ``help(FullyShardedDataParallel)`` lists them, while the public class keeps construction,
forward and gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

from shardkit.nn.fsdp.collective_calls import every_rank_calls
from shardkit.nn.fsdp.runtime import TrainingState
from shardkit.nn.fsdp.unit_module import UnitModule


class FullParamsMethods(UnitModule):
    """Gather a unit's full parameters for a block of code, or re-initialise them.

    Not used on its own: :class:`~shardkit.nn.fsdp.FullyShardedDataParallel` inherits it. Example::

        with model.summon_full_params():   # model: a FullyShardedDataParallel; every rank enters the block
            model.module.fc.weight.mul_(0.5)
    """

    @contextlib.contextmanager
    def summon_full_params(
        self, recurse: bool = True, volatile: bool = False, *, writeback: Optional[bool] = None
    ) -> Iterator[None]:
        """Gather full-precision parameters and expose them under their original names inside the block.

        Unless ``volatile`` (fairscale's name; ``writeback=False`` is the same) the values (edited in place or
        reassigned, same shape) are copied back into the shards on exit; every rank keeps its own part, so edits
        should agree across ranks. ``recurse=False`` gathers only this unit's own parameters. Not allowed inside
        forward or backward. Example::

            with model.summon_full_params():
                model.module.fc.weight.mul_(0.5)
            with model.summon_full_params(volatile=True):   # read only: nothing is copied back
                snapshot = {n: p.clone() for n, p in model.named_parameters()}
        """
        if writeback is None:
            writeback = not volatile
        elif writeback and volatile:
            raise ValueError(
                "summon_full_params(volatile=True, writeback=True) contradict each other: volatile=True means no "
                "writeback; pass only one of them"
            )
        if self._unit.state != TrainingState.SUMMON_FULL_PARAMS:
            every_rank_calls(self.process_group, "summon_full_params()")
        targets = [m.fsdp_unit for m in self.modules() if isinstance(m, UnitModule)] if recurse else [self._unit]
        entered = []
        try:
            for unit in targets:
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

    def reset_parameters(self) -> None:
        """Re-initialise the wrapped module (``module.reset_parameters()`` on its full parameters, written back
        to the shards). Only with ``allow_reset_parameters=True``: re-initialising after sharding gives
        different values than before wrapping (random streams differ), so fairscale makes it opt-in too."""
        if not self._policies.allow_reset_parameters:
            raise RuntimeError(
                "reset_parameters() after FullyShardedDataParallel wrapping is not allowed: initialise the module "
                "before wrapping, or pass allow_reset_parameters=True"
            )
        with self.summon_full_params(recurse=True):
            module: Any = self.wrapped_module  # any module class may define reset_parameters
            module.reset_parameters()
