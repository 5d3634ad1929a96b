"""The ``step`` (and ``zero_grad``) that ``smp.DistributedOptimizer`` puts in front of the user's optimizer's own.

:class:`~shardkit.modelparallel.optimizer.DistributedOptimizer` builds one subclass per user optimizer class with
one of these first in its bases: :class:`ShardedStep` with ``shard_optimizer_state``, :class:`MixedPrecisionStep`
under fp16/bf16. The subclass names the user's class as ``_smp_base``; these call its ``step`` and ``zero_grad``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def _sharded_step(self: Any, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
    """With ``shard_optimizer_state``: each replica updates the parameters it owns, then shares them (collective
    over the data-parallel group: every rank must call it)."""
    sharded = self.__dict__.get("_smp_sharded")
    if sharded is None:  # before the partition no parameter has a gradient: nothing to update
        return closure() if closure is not None else None
    return sharded.step(self.param_groups, closure, **kwargs)


class ShardedStep:
    """``step`` of a DistributedOptimizer whose state is sharded; runs the optimizer's step hooks once, as
    torch's own ``step`` wrapper does."""

    step = torch.optim.Optimizer.profile_hook_step(_sharded_step)
    setattr(step, "hooked", True)  # noqa: B010  (what torch's own step wrapper sets: never wrap it again)


def _mixed_step(self: Any, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
    """Under fp16/bf16: unscale the gradients into the FP32 masters, skip the step on an overflow (every rank),
    else update the masters with the optimizer's own step and round them into the model."""
    mixed = self._smp_mixed
    assert mixed is not None
    if closure is not None:
        raise ValueError("smp's FP16 optimizer does not take a closure in step(); run the step function, then step()")
    if self._smp_sharded is not None:  # shard_optimizer_state: each replica updates the masters it owns, shares them
        return mixed.step(self.param_groups, self._device_for_norm(), lambda: ShardedStep.step(self, **kwargs))
    base = self._smp_base  # the user's optimizer class: its (hooked) step
    return mixed.step(self.param_groups, self._device_for_norm(), lambda: base.step(self, **kwargs))


class MixedPrecisionStep:
    """``step`` and ``zero_grad`` of a DistributedOptimizer with FP32 masters (:mod:`~.precision.fp16_optimizer`).

    Its ``step`` runs the step hooks once, through the user's optimizer's own step (not at all for a skipped step);
    it is marked as torch's wrapper marks a hooked step, or torch's ``load_state_dict`` would wrap it again and
    every hook (``sdp_gradient_clipping``'s clipping among them) would run twice after a resume."""

    step = _mixed_step
    setattr(step, "hooked", True)  # noqa: B010  (what torch's own step wrapper sets: never wrap it again)

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        """Clear the masters' gradients (the optimizer's own ``zero_grad``) and the model's."""
        self._smp_base.zero_grad(self, set_to_none)
        assert self._smp_mixed is not None
        self._smp_mixed.zero_grad(set_to_none)
