"""The legacy FSDP layout ``fsdp-dcp`` (checkpoints written before the universal layout): still read and written.

FSDP checkpoints are now saved in the universal layout by :class:`~shardkit.checkpoint.adapters.fsdp.FSDPSource`;
this adapter keeps older ones loading. What it stored: parameters saved with ``sharded_state_dict`` (one
row-sharded DTensor per original parameter) by torch.distributed.checkpoint into ``model/``: every rank writes its
rows, and the checkpoint loads at any world size and wrapping. The optimizer state is gathered into the unwrapped
model's layout on rank 0 (``gather_full_optim_state_dict``) and written to ``optimizer.pt``; on load each rank cuts
its shard out of it (``get_shard_from_optim_state_dict``), again at any world size. Cost: the full optimizer state
passes through rank 0's CPU memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from torch import nn

from shardkit.checkpoint import safe_dcp, validate
from shardkit.checkpoint.adapters.base import Adapter, PendingLoad
from shardkit.checkpoint.adapters.registry import isinstance_of
from shardkit.checkpoint.errors import IncompatibleCheckpointError
from shardkit.checkpoint.files import safe_load, write_torch
from shardkit.checkpoint.metadata import CheckpointMeta
from shardkit.nn.fsdp import state_dict as sd
from shardkit.nn.fsdp.unit_module import UnitModule
from shardkit.utils.tensors import to_cpu

MODEL_DIR = "model"
OPTIMIZER_FILE = "optimizer.pt"


class FSDPAdapter(Adapter):
    """FSDP root model with a ``torch.optim`` optimizer over its flat parameters."""

    strategy = "fsdp"
    layout = "fsdp-dcp"
    resizable = True

    @property
    def fsdp(self) -> UnitModule:
        """The model, which :meth:`handles` accepted as a FullyShardedDataParallel."""
        assert isinstance(self.model, UnitModule)
        return self.model

    @staticmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """An FSDP model."""
        return isinstance_of(model, "shardkit.nn.fsdp.api", "FullyShardedDataParallel")

    def save(self, directory: Path, rank: int) -> None:
        safe_dcp.save(sd.sharded_state_dict(self.fsdp), directory / MODEL_DIR)
        if self.optimizer is not None:
            full = sd.gather_full_optim_state_dict(self.fsdp, self.optimizer, recipient_rank=0)
            if rank == 0:
                write_torch(directory / OPTIMIZER_FILE, to_cpu(full))

    def read(self, directory: Path, meta: CheckpointMeta, rank: int) -> PendingLoad:
        saved_shapes = safe_dcp.global_shapes(directory / MODEL_DIR)
        shard = self._read_optimizer(directory, meta) if self.optimizer is not None else None
        target: dict[str, Any] = {}

        def fetch() -> None:
            target.update(sd.sharded_state_dict(self.fsdp))  # collective; a fresh copy, the model is untouched
            validate.check_model_state(validate.shapes_of(target), dict(saved_shapes), "the sharded model state")
            safe_dcp.load(target, directory / MODEL_DIR)

        def apply() -> None:
            sd.load_sharded_state_dict(self.fsdp, target)
            if shard is not None:
                assert self.optimizer is not None
                self.optimizer.load_state_dict(shard)

        return PendingLoad(apply=apply, fetch=fetch)

    def _read_optimizer(self, directory: Path, meta: CheckpointMeta) -> dict[str, Any]:
        assert self.optimizer is not None
        if not meta.has_optimizer:
            raise IncompatibleCheckpointError(
                f"{directory} holds no optimizer state; load it with optimizer=None and start the optimizer afresh"
            )
        full = safe_load(directory / OPTIMIZER_FILE, "optimizer state")
        try:
            shard = sd.get_shard_from_optim_state_dict(self.fsdp, full, self.optimizer)
        except (ValueError, KeyError, TypeError) as err:
            raise IncompatibleCheckpointError(f"the optimizer state does not fit this model: {err}") from None
        validate.check_optimizer_state(shard, validate.optimizer_groups(self.optimizer), "the optimizer state")
        return shard
