"""``shardkit.nn.slowmo.SlowMoDistributedDataParallel``: per-rank state, one file per rank.

Between synchronisations every rank has its own parameters, optimizer state and push-sum weight, so each rank
writes ``slowmo/rank_<r>.pt`` with: the wrapper's state dict (its parameters plus the push-sum ``ps_weight``), the
optimizer state, the step counter that drives the LocalSGD / gossip / slow-momentum schedule, the gossip round
(it picks the peers), and the slow-momentum buffers (``x0`` and ``u``, whole or this rank's shard). The state only
means something at the world size it was saved at, so loading elsewhere is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from shardkit.checkpoint import validate
from shardkit.checkpoint.adapters.base import Adapter, PendingLoad, as_state, named_parameter_ids
from shardkit.checkpoint.adapters.registry import isinstance_of
from shardkit.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardkit.checkpoint.files import safe_load, write_torch
from shardkit.checkpoint.metadata import CheckpointMeta
from shardkit.utils.tensors import to_cpu


def _shape(value: Any) -> Any:
    return None if value is None else tuple(value.shape)


def rank_file(directory: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its SlowMo state."""
    return directory / "slowmo" / f"rank_{rank:05d}.pt"


class SlowMoAdapter(Adapter):
    """SlowMo wrapper with a plain ``torch.optim`` optimizer; every rank saves and loads its own state."""

    strategy = "slowmo"
    layout = "per-rank"
    resizable = False

    @staticmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """A SlowMo wrapper."""
        return isinstance_of(model, "shardkit.nn.slowmo.api", "SlowMoDistributedDataParallel")

    def check_idle(self) -> None:
        """Refuse to save while gossip rounds are in flight (their messages are part of no rank's state)."""
        model: Any = self.model
        gossiper = model.gossiper
        if gossiper is not None and gossiper.in_flight:
            raise RuntimeError(
                "SlowMo has gossip rounds in flight (overlap=True): they cannot be saved. Call model.eval() first "
                "(it completes them; model.train() resumes), or save after a step that drains gossip"
            )

    def save(self, directory: Path, rank: int) -> None:
        self.check_idle()
        model: Any = self.model
        gossiper = model.gossiper
        slow = model.slow_momentum
        state = {
            "model": model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "num_updates": int(model.num_updates),
            "gossip_round": None if gossiper is None else int(gossiper.round_index),
            "slow_anchor": None if slow is None else slow.anchor,
            "slow_momentum": None if slow is None else slow.momentum,
        }
        write_torch(rank_file(directory, rank), to_cpu(state))

    def read(self, directory: Path, meta: CheckpointMeta, rank: int) -> PendingLoad:
        path = rank_file(directory, rank)
        saved = as_state(safe_load(path, "SlowMo state"), path)
        expected_keys = ("model", "optimizer", "num_updates", "gossip_round", "slow_anchor", "slow_momentum")
        if any(key not in saved for key in expected_keys):
            raise CorruptCheckpointError(f"{path} lacks some of {expected_keys}")
        model_state = as_state(saved["model"], path)
        validate.check_model_state(
            validate.shapes_of(self.model.state_dict()), validate.shapes_of(model_state), "the model state"
        )
        if self.optimizer is not None:
            if saved["optimizer"] is None:
                raise IncompatibleCheckpointError(f"{path} holds no optimizer state; load it with optimizer=None")
            groups = validate.optimizer_groups(self.optimizer, named_parameter_ids(self.model))
            validate.check_optimizer_state(saved["optimizer"], groups, "the optimizer state")
        self._check_slow(saved, path)

        def apply() -> None:
            self._apply(saved, model_state)

        return PendingLoad(apply=apply)

    def _check_slow(self, saved: Mapping[str, Any], path: Path) -> None:
        model: Any = self.model
        slow = model.slow_momentum
        for name in ("anchor", "momentum"):
            ours, theirs = getattr(slow, name, None), saved[f"slow_{name}"]
            if (ours is None) != (theirs is None) or (ours is not None and ours.shape != theirs.shape):
                raise IncompatibleCheckpointError(
                    f"{path}: the slow-momentum buffer {name} does not fit this SlowMo configuration (saved "
                    f"{_shape(theirs)}, here {_shape(ours)}); build SlowMo with the settings it was saved with"
                )

    def _apply(self, saved: Mapping[str, Any], model_state: Any) -> None:
        model: Any = self.model
        model.load_state_dict(dict(model_state))  # also the push-sum weight; resets the slow-momentum anchor
        if self.optimizer is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
        model.num_updates = int(saved["num_updates"])
        gossiper = model.gossiper
        if gossiper is not None and saved["gossip_round"] is not None:
            gossiper.round_index = int(saved["gossip_round"])
        slow = model.slow_momentum
        if slow is not None and slow.anchor is not None:
            with torch.no_grad():
                slow.anchor.copy_(saved["slow_anchor"])
                slow.momentum.copy_(saved["slow_momentum"])
