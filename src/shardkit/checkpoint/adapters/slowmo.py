"""``shardkit.nn.slowmo.SlowMoDistributedDataParallel``: the cross-rank average, loadable anywhere, plus per-rank files.

:class:`SlowMoSource` saves the universal layout: the average of every rank's parameters and optimizer state
(computed into copies) for any strategy to load, and each rank's own state in ``slowmo/rank_<r>.pt`` so that a
SlowMo run at the same world size resumes bitwise.

:class:`SlowMoAdapter` is that per-rank file, and the legacy ``per-rank`` layout (only that file; loads only at its
world size). Between synchronisations every rank has its own parameters, optimizer state and push-sum weight, so
each rank writes the wrapper's state dict (its parameters plus the push-sum ``ps_weight``), the optimizer state,
the step counter that drives the LocalSGD / gossip / slow-momentum schedule, the gossip round (it picks the peers),
and the slow-momentum buffers (``x0`` and ``u``, whole or this rank's shard).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from shardkit.checkpoint import validate
from shardkit.checkpoint._collectives import rank_and_size
from shardkit.checkpoint.adapters.base import Adapter, PendingLoad, as_state, named_parameter_ids
from shardkit.checkpoint.adapters.registry import isinstance_of
from shardkit.checkpoint.adapters.slowmo_average import average_params, averaged_optimizer, broadcast_copies
from shardkit.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardkit.checkpoint.files import safe_load, write_torch
from shardkit.checkpoint.metadata import CheckpointMeta
from shardkit.checkpoint.universal.placement import replica_share
from shardkit.checkpoint.universal.source import Held, Span, UniversalSource
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


class SlowMoSource(UniversalSource):
    """SlowMo in the universal layout (the cross-rank average, loadable anywhere) plus per-rank files.

    Save: :meth:`before_save` averages the parameters (push-sum weighted) and optimizer state over every rank and
    takes rank 0's buffers (see :mod:`.slowmo_average`); each rank keeps, in copies, only the flat range of every
    tensor it writes, so the ranks' copies together are one model and one optimizer state. The live model and
    optimizer never change. Each rank also writes today's
    per-rank file (:class:`SlowMoAdapter`'s ``slowmo/rank_<r>.pt``: its own parameters, push-sum weight, optimizer
    state, counters, gossip round and slow-momentum buffers).

    Load: the universal part is written into the live parameters and optimizer on every rank, the push-sum weight
    becomes 1 and the slow-momentum anchor the loaded point. When the checkpoint was written by SlowMo at this
    world size, each rank's own file then restores its per-replica state bitwise.

    Example::

        save_checkpoint("ckpt/step_90", step=90, model=slowmo_model, optimizer=optimizer)
        load_checkpoint("ckpt/step_90", model=fsdp_model, optimizer=fsdp_optimizer)  # the average, anywhere
    """

    strategy = "slowmo"

    def __init__(self, model: nn.Module, optimizer: Optional[Any]) -> None:
        self.model: Any = model
        self.optimizer = optimizer
        self._legacy = SlowMoAdapter(model, optimizer)
        #: While saving (from before_save to after_save): this rank's shares of the averaged tensors, and the
        #: optimizer over them.
        self._copies: Optional[tuple[list[Held], Optional[torch.optim.Optimizer]]] = None
        #: Whether the load restored this rank's own state from its per-rank file.
        self._restored_own = False

    @staticmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """A SlowMo wrapper."""
        return SlowMoAdapter.handles(model, optimizer)

    def _named(self) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        inner: nn.Module = self.model.module
        persistent = set(inner.state_dict(keep_vars=True))
        params: list[tuple[str, torch.Tensor]] = list(inner.named_parameters())
        buffers = [(n, b) for n, b in inner.named_buffers() if n in persistent]
        return params, buffers

    def held(self) -> list[Held]:
        """While saving, this rank's share of each averaged tensor (the ranks' shares tile it); otherwise the live
        parameters and buffers, which every rank holds whole."""
        if self._copies is not None:
            return self._copies[0]
        rank, world = rank_and_size()
        params, buffers = self._named()
        return [Held(t, (Span(n, t.shape, 0, t.numel(), 0),), rank, world) for n, t in params + buffers]

    def local_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer over the averaged copies while saving, the live optimizer otherwise."""
        if self._copies is not None:
            return self._copies[1]
        return self.optimizer

    def aliases(self) -> dict[str, str]:
        """Tied parameter names of the wrapped module -> the first name."""
        inner: nn.Module = self.model.module
        first: dict[int, str] = {}
        out = {}
        for name, p in inner.named_parameters(remove_duplicate=False):
            if first.setdefault(id(p), name) != name:
                out[name] = first[id(p)]
        return out

    def before_save(self) -> None:
        """Average parameters and optimizer state over the ranks; keep this rank's share of each (collective)."""
        self._legacy.check_idle()
        model = self.model
        group, device = model.groups.global_group, model.comm_device
        rank, world = rank_and_size()
        params, buffers = self._named()
        param_shares = [replica_share(p.numel(), rank, world) for _, p in params]
        buffer_shares = [replica_share(b.numel(), rank, world) for _, b in buffers]
        push_sum = model.push_sum_state
        weight = 1.0 if push_sum is None else push_sum.weight
        numerators = push_sum is None or push_sum.form.value == "numerator"
        copies = average_params([p for _, p in params], param_shares, weight, numerators, group, device)
        buffer_copies = broadcast_copies([b for _, b in buffers], buffer_shares, group, device)
        held = [
            Held(copy_, (Span(name, t.shape, lo, hi, 0),))
            for (name, t), copy_, (lo, hi) in zip(
                params + buffers, copies + buffer_copies, param_shares + buffer_shares
            )
        ]
        copy_of = {id(p): (c, share) for (_, p), c, share in zip(params, copies, param_shares)}
        shadow = None if self.optimizer is None else averaged_optimizer(self.optimizer, copy_of, group, device)
        self._copies = (held, shadow)

    def after_save(self) -> None:
        """Drop the averaged copies."""
        self._copies = None

    def save_extra(self, directory: Path, rank: int) -> None:
        """This rank's own SlowMo state, for a bitwise resume at the same world size."""
        self._legacy.save(directory, rank)

    def read_extra(self, directory: Path, meta: CheckpointMeta, rank: int) -> Optional[Callable[[], None]]:
        """Saved by SlowMo at this world size: this rank's own state, restored after the average was written."""
        self._restored_own = False
        if meta.strategy != self.strategy or meta.world_size != rank_and_size()[1]:
            return None
        if not rank_file(directory, rank).is_file():
            raise CorruptCheckpointError(f"{rank_file(directory, rank)} is missing: this SlowMo rank's own state")
        apply_own = self._legacy.read(directory, meta, rank).apply

        def apply() -> None:
            apply_own()
            self._restored_own = True

        return apply

    def after_load(self) -> None:
        """Loaded the average only: it is a point every rank shares (push-sum weight 1, slow-momentum anchor)."""
        if not self._restored_own:
            self.model.restart_from_parameters()
