"""``smp.DistributedOptimizer``: an optimizer whose state dicts know about pipeline stages.

The wrapped optimizer is used as is (``step``, ``zero_grad``, ``param_groups`` pass through); parameters a stage
released have no gradient, so the optimizer skips them and never builds state for them. State dicts use the
torch format (parameters by index in ``param_groups`` order), so a full one loads into a plain optimizer built
over the unwrapped model's parameters in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from shardkit.distributed import collectives as C
from shardkit.modelparallel import checkpoint as ckpt
from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.optimizers import FusedLamb


class DistributedOptimizer:
    """Wrap ``optimizer`` (built over the DistributedModel's parameters) for stage-aware state dicts.

    A :class:`~shardkit.modelparallel.optimizers.FusedLamb` inside gets its global gradient norm summed over
    the replica's stages (each parameter counted once), so its clipping matches single-process training;
    every rank must then call ``step()``.

    Example::

        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        ...
        optimizer.step()
        smp.save({"optimizer": optimizer.local_state_dict()}, "ckpt.pt", partial=True)
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"smp.DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        state = smp_state.current()
        self.optimizer = optimizer
        self._smp = state
        self._pending: Optional[dict[str, Any]] = None
        state.optimizer = self
        if isinstance(optimizer, FusedLamb):  # its global gradient norm spans every stage
            optimizer.set_sum_of_squares(self._sum_over_stages)

    def _sum_over_stages(self, params: Sequence[torch.Tensor], squares: torch.Tensor) -> torch.Tensor:
        """Sum of per-parameter squares over the replica's stages, each parameter counted once (collective)."""
        model = self._smp.model
        if model is None or not model.partitioned or self._smp.topology.mp_size == 1 or not self._smp.distributed:
            return squares.sum()
        mask = torch.tensor(model.first_holder_mask(params), dtype=torch.bool, device=squares.device)
        total = torch.where(mask, squares, torch.zeros_like(squares)).sum().reshape(1).to(model.execution_device)
        C.all_reduce(total, group=self._smp.mp_group, label="smp_global_grad_norm")
        return total.reshape(()).to(squares.device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's step (only parameters with gradients, i.e. this stage's, move)."""
        return self.optimizer.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    def _held_indices(self) -> Optional[set[int]]:
        model = self._smp.model
        if model is None or not model.partitioned:
            return None
        held = {id(p) for p in model.local_parameters()}
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return {i for i, p in enumerate(params) if id(p) in held}

    def local_state_dict(self) -> dict[str, Any]:
        """State of the parameters this stage holds, marked ``_smp_is_partial``."""
        full = self.optimizer.state_dict()
        held = self._held_indices()
        if held is not None:
            full["state"] = {i: v for i, v in full["state"].items() if i in held}
        full[ckpt.PARTIAL_KEY] = True
        return full

    def state_dict(self) -> dict[str, Any]:
        """State of every stage's parameters, gathered (collective over the replica's stages)."""
        partials = ckpt.gather_partials(self.local_state_dict(), self._smp.mp_group, "smp_optimizer_state_dict")
        return ckpt.merge_optimizer_partials(partials)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full or partial (gathered first: collective) state dict; waits for the partition if needed."""
        if ckpt.is_partial(state_dict):
            partials = ckpt.gather_partials(state_dict, self._smp.mp_group, "smp_optimizer_load_state_dict")
            full = ckpt.merge_optimizer_partials(partials)
        else:
            full = {"state": state_dict["state"], "param_groups": state_dict["param_groups"]}
        model = self._smp.model
        if model is not None and not model.partitioned:
            self._pending = full
            return
        self._load(full)

    def load_pending_state(self) -> None:
        """Load a state dict given before the model was partitioned (the model calls it right after)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._load(pending)

    def _load(self, full: dict[str, Any]) -> None:
        held = self._held_indices()
        state = full["state"] if held is None else {i: v for i, v in full["state"].items() if int(i) in held}
        self.optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})
