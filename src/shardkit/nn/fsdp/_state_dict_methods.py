"""The state-dict methods of :class:`~shardkit.nn.fsdp.FullyShardedDataParallel`, kept apart from the runtime.

Each method delegates to :mod:`shardkit.nn.fsdp.state_dict`, imported on use: the state-dict code builds on the
wrapper class, not the other way round.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch

from shardkit.nn.fsdp.collective_calls import every_rank_calls


def _state_dict_module() -> Any:
    return importlib.import_module("shardkit.nn.fsdp.state_dict")


class StateDictMethods:
    """Full, local, DCP-sharded and optimizer state dicts (mixed into the wrapper before ``nn.Module``)."""

    #: The wrapper's process group (set by its constructor); every rank of it must call the collective methods.
    process_group: Any

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Full, unflattened state dict with the unwrapped model's keys (see :mod:`shardkit.nn.fsdp.state_dict`)."""
        every_rank_calls(self.process_group, "state_dict()")
        sd = _state_dict_module()
        return sd.state_dict(self, *args, **kwargs)

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        """Load a full state dict (as returned by :meth:`state_dict` or by the unwrapped model)."""
        every_rank_calls(self.process_group, "load_state_dict()")
        sd = _state_dict_module()
        return sd.load_state_dict(self, state_dict, *args, **kwargs)

    def local_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's shards and buffers, for saving and loading at the same world size."""
        sd = _state_dict_module()
        return sd.local_state_dict(self, *args, **kwargs)

    def load_local_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        """Load what :meth:`local_state_dict` returned on this rank."""
        sd = _state_dict_module()
        return sd.load_local_state_dict(self, state_dict, *args, **kwargs)

    def local_metadata_dict(self) -> dict[str, Any]:
        """How this rank's :meth:`local_state_dict` maps onto the full model, for :meth:`consolidate_shard_weights`."""
        sd = _state_dict_module()
        result: dict[str, Any] = sd.local_metadata_dict(self)
        return result

    @staticmethod
    def consolidate_shard_weights(
        shard_weights: list[dict[str, torch.Tensor]],
        shard_metadata: list[dict[str, Any]],
        with_module_buffers: bool = True,
        strict: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The full state dict from every rank's :meth:`local_state_dict` and :meth:`local_metadata_dict`, offline
        (no processes, no model; see :mod:`shardkit.nn.fsdp.state_dict.consolidate`)."""
        sd = _state_dict_module()
        result: dict[str, torch.Tensor] = sd.consolidate_shard_weights(
            shard_weights, shard_metadata, with_module_buffers, strict
        )
        return result

    def gather_full_optim_state_dict(self, optim: torch.optim.Optimizer, **ignored: Any) -> Any:
        """The optimizer state for the full, unflattened model (see :mod:`shardkit.nn.fsdp.state_dict`).

        ``recipient_rank`` (default 0) is the one keyword used; fairscale's other keywords are ignored, as there.
        """
        every_rank_calls(self.process_group, "gather_full_optim_state_dict()")
        sd = _state_dict_module()
        return sd.gather_full_optim_state_dict(self, optim, recipient_rank=ignored.get("recipient_rank", 0))

    def get_shard_from_optim_state_dict(
        self, full_optim_state_dict: dict[str, Any], optim: Optional[torch.optim.Optimizer] = None
    ) -> Any:
        """This rank's part of a full optimizer state dict, ready for ``optim.load_state_dict``."""
        sd = _state_dict_module()
        return sd.get_shard_from_optim_state_dict(self, full_optim_state_dict, optim=optim)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Per original parameter a row-sharded DTensor, for ``torch.distributed.checkpoint.save``.

        Example::

            torch.distributed.checkpoint.save({"model": model.sharded_state_dict()}, checkpoint_id=path)
        """
        every_rank_calls(self.process_group, "sharded_state_dict()")
        sd = _state_dict_module()
        return sd.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: Any, strict: bool = True) -> Any:
        """Load what ``torch.distributed.checkpoint.load`` filled in from :meth:`sharded_state_dict`, at any
        world size."""
        every_rank_calls(self.process_group, "load_sharded_state_dict()")
        sd = _state_dict_module()
        return sd.load_sharded_state_dict(self, state_dict, strict=strict)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Reached only when an *unwrapped* parent's load_state_dict recurses into this unit (auto_wrap case).
        _state_dict_module().load_from_state_dict_hook(self, state_dict, prefix, *args)
