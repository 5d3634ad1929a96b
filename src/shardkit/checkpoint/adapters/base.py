"""What a strategy adapter does: save its state into a directory, and read it back in two checked phases.

Loading is split so that nothing is written into the model or optimizer until every rank has read and checked
everything: :meth:`Adapter.read` (this rank alone, no collectives: read files, validate), then
:meth:`PendingLoad.fetch` (collectives every rank issues, such as filling DCP targets), then
:meth:`PendingLoad.apply` (the only step that changes the model and optimizer).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from torch import nn

from shardkit.checkpoint.errors import CorruptCheckpointError
from shardkit.checkpoint.metadata import CheckpointMeta
from shardkit.checkpoint.pending import PendingLoad  # defined below the engine, which also returns it


class Adapter(abc.ABC):
    """Saves and loads the model and optimizer state of one strategy."""

    #: Name recorded in the checkpoint.
    strategy: str = ""
    #: How the state is stored; a checkpoint loads into any strategy with the same layout.
    layout: str = ""
    #: Whether a checkpoint loads at another world size.
    resizable: bool = True

    def __init__(self, model: nn.Module, optimizer: Optional[Any]) -> None:
        self.model = model
        self.optimizer = optimizer

    @staticmethod
    @abc.abstractmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """Whether this adapter is the one for ``model`` and ``optimizer``."""

    @abc.abstractmethod
    def save(self, directory: Path, rank: int) -> None:
        """Write the model and optimizer state into ``directory``; called on every rank (may be collective)."""

    @abc.abstractmethod
    def read(self, directory: Path, meta: CheckpointMeta, rank: int) -> PendingLoad:
        """Read and validate this rank's part of the checkpoint without collectives or changing anything."""


def as_state(value: Any, path: Path) -> Mapping[str, Any]:
    """``value`` if it is a state dict (a mapping with string keys), else a CorruptCheckpointError."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise CorruptCheckpointError(f"{path} should hold a state dict but holds a {type(value).__name__}")
    return value


def named_parameter_ids(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for naming parameters in error messages."""
    return {id(p): name for name, p in module.named_parameters()}
