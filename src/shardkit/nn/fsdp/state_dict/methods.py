"""The state-dict methods of :class:`~shardkit.nn.fsdp.FullyShardedDataParallel`, as a base class it inherits.

Each method checks that every rank calls it (:mod:`shardkit.nn.fsdp.collective_calls`) where it gathers, then
hands over to the functions of this package, which do the work on a :class:`~shardkit.nn.fsdp.unit_module.UnitModule`.
The public class inherits these methods, so users call them on the FSDP object (``model.state_dict()``) and
``help(FullyShardedDataParallel)`` lists them; keeping them here keeps the public class to construction, forward,
full parameters and gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from shardkit.nn._torch_private import IncompatibleKeys
from shardkit.nn.fsdp import state_dict as sd
from shardkit.nn.fsdp.collective_calls import every_rank_calls
from shardkit.nn.fsdp.unit_module import UnitModule


class StateDictMethods(UnitModule):
    """Full, local, DCP-sharded and optimizer state dicts of one wrapped unit (see :mod:`shardkit.nn.fsdp.state_dict`).

    Not used on its own: :class:`~shardkit.nn.fsdp.FullyShardedDataParallel` inherits it. Example::

        torch.save(model.state_dict(), "full.pt")   # model: a FullyShardedDataParallel; every rank calls it
        model.load_state_dict(torch.load("full.pt"))
    """

    def state_dict(  # type: ignore[override]
        self,
        *args: Any,
        destination: Optional[dict[str, Any]] = None,
        prefix: str = "",
        keep_vars: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Full, unflattened state dict with the unwrapped model's keys (see :mod:`shardkit.nn.fsdp.state_dict`).

        Takes ``nn.Module.state_dict``'s keywords (fairscale's signature is ``(*args, **kwargs)``); call on
        every rank.
        """
        _no_more("state_dict", kwargs)
        every_rank_calls(self.process_group, "state_dict()")
        return sd.state_dict(self, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> IncompatibleKeys:
        """Load a full state dict (as returned by :meth:`state_dict` or by the unwrapped model)."""
        every_rank_calls(self.process_group, "load_state_dict()")
        return sd.load_state_dict(self, state_dict, strict, assign)

    def local_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's shards and buffers, for saving and loading at the same world size and wrapping.

        Takes ``nn.Module.state_dict``'s ``destination``, ``prefix`` and ``keep_vars`` (by keyword or in that
        order), as fairscale's does: keys get ``prefix``, entries are added to ``destination`` (returned), and
        ``keep_vars=True`` keeps the shards as the parameters themselves. No communication. Example::

            torch.save(model.local_state_dict(), f"shard{rank}.pt")
            sub = model.local_state_dict(destination={}, prefix="model.")   # as a parent's state_dict asks
        """
        return sd.local_state_dict(self, **_state_dict_arguments("local_state_dict", args, kwargs))

    def load_local_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Load what :meth:`local_state_dict` returned on this rank."""
        return sd.load_local_state_dict(self, state_dict, strict)

    def local_metadata_dict(self) -> dict[str, Any]:
        """How this rank's :meth:`local_state_dict` maps onto the full model, for :meth:`consolidate_shard_weights`."""
        return sd.local_metadata_dict(self)

    @staticmethod
    def consolidate_shard_weights(
        shard_weights: list[dict[str, torch.Tensor]],
        shard_metadata: list[dict[str, Any]],
        with_module_buffers: bool = True,
        strict: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The full state dict from every rank's :meth:`local_state_dict` and :meth:`local_metadata_dict`, offline
        (no processes, no model; see :mod:`shardkit.nn.fsdp.state_dict.consolidate`)."""
        return sd.consolidate_shard_weights(shard_weights, shard_metadata, with_module_buffers, strict)

    def gather_full_optim_state_dict(self, optim: Any, **ignored: Any) -> Optional[dict[str, Any]]:
        """The optimizer state for the full, unflattened model (see :mod:`shardkit.nn.fsdp.state_dict`).

        ``optim`` is the torch optimizer built from ``model.parameters()``, or a wrapper around it with
        ``param_groups`` and ``state_dict()``. ``recipient_rank`` (default 0) is the one keyword used;
        fairscale's other keywords are ignored, as there. A wrong ``optim`` is refused on every rank.
        """
        local_error = sd.optim_input_error(optim)
        call = "gather_full_optim_state_dict()"
        # A rank refusing its input says so in the call name, so the others raise too instead of waiting.
        every_rank_calls(self.process_group, call if local_error is None else f"{call} refused: {local_error}")
        if local_error is not None:
            raise TypeError(local_error)
        return sd.gather_full_optim_state_dict(self, optim, recipient_rank=ignored.get("recipient_rank", 0))

    def get_shard_from_optim_state_dict(
        self, full_optim_state_dict: dict[str, Any], optim: Optional[torch.optim.Optimizer] = None
    ) -> dict[str, Any]:
        """This rank's part of a full optimizer state dict, ready for ``optim.load_state_dict``."""
        return sd.get_shard_from_optim_state_dict(self, full_optim_state_dict, optim=optim)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Per original parameter a row-sharded DTensor, for ``torch.distributed.checkpoint.save``.

        Example::

            torch.distributed.checkpoint.save({"model": model.sharded_state_dict()}, checkpoint_id=path)
        """
        every_rank_calls(self.process_group, "sharded_state_dict()")
        return sd.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Load what ``torch.distributed.checkpoint.load`` filled in from :meth:`sharded_state_dict`, at any
        world size."""
        every_rank_calls(self.process_group, "load_sharded_state_dict()")
        return sd.load_sharded_state_dict(self, state_dict, strict=strict)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Reached only when an *unwrapped* parent's load_state_dict recurses into this unit (auto_wrap case).
        sd.load_from_state_dict_hook(self, state_dict, prefix, *args)


_STATE_DICT_ARGS = ("destination", "prefix", "keep_vars")


def _state_dict_arguments(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``nn.Module.state_dict``'s arguments, given by keyword or in its order, as a keyword dict."""
    unknown = sorted(set(kwargs) - set(_STATE_DICT_ARGS))
    if unknown or len(args) > len(_STATE_DICT_ARGS):
        got = f"unexpected keyword arguments {unknown}" if unknown else f"{len(args)} positional arguments"
        raise TypeError(f"{method}() got {got}; it takes nn.Module.state_dict's destination, prefix, keep_vars")
    given = dict(zip(_STATE_DICT_ARGS, args))
    twice = sorted(set(given) & set(kwargs))
    if twice:
        raise TypeError(f"{method}() got {twice} both by position and by keyword; pass each once")
    return {**given, **kwargs}


def _no_more(method: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise TypeError(f"{method}() got unexpected keyword arguments {sorted(kwargs)}")
