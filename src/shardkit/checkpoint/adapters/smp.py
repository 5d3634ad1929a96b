"""``shardkit.modelparallel`` (smp): a ``DistributedModel`` and ``DistributedOptimizer`` (full layout).

``state_dict()`` of both gathers every pipeline stage's part (a collective over the model-parallel group), so
rank 0 holds and writes the whole model and optimizer, with the unwrapped module's keys. Loading hands the full
dicts to smp, which keeps what each stage holds (or keeps them until the partition, if it has not happened yet);
so a checkpoint loads under another partition count or world size, and into the plain model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from torch import nn

from shardkit.checkpoint import validate
from shardkit.checkpoint.adapters.base import named_parameter_ids
from shardkit.checkpoint.adapters.full import FullStateAdapter
from shardkit.checkpoint.adapters.registry import isinstance_of

_MODEL = ("shardkit.modelparallel.model", "DistributedModel")
_OPTIMIZER = ("shardkit.modelparallel.optimizer", "DistributedOptimizer")


class SMPAdapter(FullStateAdapter):
    """smp model (and optimizer): gathered on save, each stage keeps its part on load."""

    strategy = "smp"

    def __init__(self, model: nn.Module, optimizer: Optional[Any]) -> None:
        super().__init__(model, optimizer)
        if optimizer is not None and not isinstance_of(optimizer, *_OPTIMIZER):
            raise TypeError(
                f"an smp.DistributedModel is saved with its smp.DistributedOptimizer, got {type(optimizer).__name__};"
                " wrap it: smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), ...))"
            )

    @staticmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """An smp DistributedModel."""
        return isinstance_of(model, *_MODEL)

    def model_state(self) -> Mapping[str, Any]:
        return self.model.state_dict()  # gathered over the stages

    def expected_model(self) -> dict[str, validate.Shape]:
        # Tensors this stage released are empty: their shape is only known to the stage holding them.
        inner: nn.Module = self.model.module  # type: ignore[assignment]
        return {key: tuple(value.shape) if value.numel() else None for key, value in inner.state_dict().items()}

    def optimizer_groups(self) -> list[list[tuple[str, validate.Shape]]]:
        assert self.optimizer is not None
        inner: nn.Module = self.model.module  # type: ignore[assignment]
        return validate.optimizer_groups(self.optimizer.optimizer, named_parameter_ids(inner))

    def load_model(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(dict(state))  # held parts now, or at the partition
