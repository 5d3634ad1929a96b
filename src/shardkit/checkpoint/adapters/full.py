"""The "full" layout: the unwrapped model's state dict and a ``torch.optim`` state dict, written by rank 0.

Shared by every strategy whose full state fits one process (plain, torch DDP, OSS, OSS + ShardedDataParallel,
smp): their files are interchangeable, and load at any world size, because they hold what the unwrapped model
and a plain optimizer would save.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from torch import nn

from shardkit.checkpoint import validate
from shardkit.checkpoint.adapters.base import Adapter, PendingLoad, as_state, named_parameter_ids
from shardkit.checkpoint.errors import IncompatibleCheckpointError
from shardkit.checkpoint.files import safe_load, write_torch
from shardkit.checkpoint.metadata import CheckpointMeta
from shardkit.utils.tensors import to_cpu

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"


class FullStateAdapter(Adapter):
    """Rank 0 writes ``model.pt`` and ``optimizer.pt``; every rank reads both. Subclasses say how to get them."""

    layout = "full"
    resizable = True

    def unwrapped(self) -> nn.Module:
        """The module whose state dict is saved (wrappers that add a ``module.`` level are looked through)."""
        return self.model

    def model_state(self) -> Mapping[str, Any]:
        """The full model state dict (called on every rank; may be collective)."""
        return self.unwrapped().state_dict()

    def optimizer_state(self) -> Optional[Mapping[str, Any]]:
        """The full optimizer state dict on rank 0 (called on every rank; may be collective)."""
        assert self.optimizer is not None
        return self.optimizer.state_dict()

    def expected_model(self) -> dict[str, validate.Shape]:
        """Keys and shapes the model state must have."""
        return validate.shapes_of(self.unwrapped().state_dict())

    def optimizer_groups(self) -> list[list[tuple[str, validate.Shape]]]:
        """Per param group, ``(name, shape)`` of its parameters."""
        assert self.optimizer is not None
        return validate.optimizer_groups(self.optimizer, named_parameter_ids(self.unwrapped()))

    def load_model(self, state: Mapping[str, Any]) -> None:
        """Load a validated full model state dict."""
        self.unwrapped().load_state_dict(state)

    def load_optimizer(self, state: Mapping[str, Any]) -> None:
        """Load a validated full optimizer state dict."""
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state)

    def save(self, directory: Path, rank: int) -> None:
        model_state = self.model_state()
        optimizer_state = self.optimizer_state() if self.optimizer is not None else None
        if rank == 0:
            write_torch(directory / MODEL_FILE, to_cpu(dict(model_state)))
            if optimizer_state is not None:
                write_torch(directory / OPTIMIZER_FILE, to_cpu(dict(optimizer_state)))

    def read(self, directory: Path, meta: CheckpointMeta, rank: int) -> PendingLoad:
        model_state = as_state(safe_load(directory / MODEL_FILE, "model state"), directory / MODEL_FILE)
        validate.check_model_state(self.expected_model(), validate.shapes_of(model_state), "the model state")
        optimizer_state: Optional[Mapping[str, Any]] = None
        if self.optimizer is not None:
            if not meta.has_optimizer:
                raise IncompatibleCheckpointError(
                    f"{directory} holds no optimizer state (it was saved without an optimizer); "
                    "load it with optimizer=None and start the optimizer afresh"
                )
            optimizer_state = safe_load(directory / OPTIMIZER_FILE, "optimizer state")
            validate.check_optimizer_state(optimizer_state, self.optimizer_groups(), "the optimizer state")

        def apply() -> None:
            self.load_model(model_state)
            if optimizer_state is not None:
                self.load_optimizer(optimizer_state)

        return PendingLoad(apply=apply)
