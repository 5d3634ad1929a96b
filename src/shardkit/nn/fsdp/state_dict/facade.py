"""The state-dict facade a :class:`~shardkit.nn.fsdp.FullyShardedDataParallel` holds and delegates its state-dict
methods to.

Each call checks its arguments, makes sure every rank calls it (:mod:`shardkit.nn.fsdp.collective_calls`) where it
gathers, then hands over to the functions of this package, which read the unit through
:func:`shardkit.nn.fsdp.layout`. The facade knows the unit only as a
:class:`~shardkit.nn.fsdp.unit_module.UnitModule`, so the public class imports this layer, never the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from shardkit.nn._torch_private import IncompatibleKeys
from shardkit.nn.fsdp.collective_calls import every_rank_calls
from shardkit.nn.fsdp.state_dict import consolidate, full, optim, sharded
from shardkit.nn.fsdp.unit_module import UnitModule


class StateDictFacade:
    """Full, local, DCP-sharded and optimizer state dicts of one wrapped unit (see :mod:`shardkit.nn.fsdp.state_dict`).

    Example (what ``model.state_dict()`` runs; every rank calls it)::

        full = StateDictFacade(model).state_dict()
    """

    def __init__(self, owner: UnitModule) -> None:
        self.owner = owner

    def _every_rank_calls(self, what: str) -> None:
        every_rank_calls(self.owner.process_group, what)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Full, unflattened state dict (``nn.Module.state_dict``'s keywords only); every rank calls it."""
        options = _state_dict_arguments("state_dict", args, kwargs, positional=False)
        self._every_rank_calls("state_dict()")
        return full.state_dict(self.owner, **options)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool, assign: bool) -> IncompatibleKeys:
        """Load a full state dict; every rank calls it."""
        self._every_rank_calls("load_state_dict()")
        return full.load_state_dict(self.owner, state_dict, strict, assign)

    def local_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's shards and buffers (``nn.Module.state_dict``'s arguments, by keyword or in its order)."""
        return full.local_state_dict(self.owner, **_state_dict_arguments("local_state_dict", args, kwargs))

    def load_local_state_dict(self, state_dict: Mapping[str, Any], strict: bool) -> IncompatibleKeys:
        """Load what :meth:`local_state_dict` returned on this rank."""
        return full.load_local_state_dict(self.owner, state_dict, strict)

    def local_metadata_dict(self) -> dict[str, Any]:
        """How this rank's local state dict maps onto the full model."""
        return consolidate.local_metadata_dict(self.owner)

    def gather_full_optim_state_dict(self, optim_like: Any, recipient_rank: int) -> Optional[dict[str, Any]]:
        """The optimizer state for the full model on ``recipient_rank``; a wrong ``optim_like`` is refused on
        every rank."""
        local_error = optim.optim_input_error(optim_like)
        call = "gather_full_optim_state_dict()"
        # A rank refusing its input says so in the call name, so the others raise too instead of waiting.
        self._every_rank_calls(call if local_error is None else f"{call} refused: {local_error}")
        if local_error is not None:
            raise TypeError(local_error)
        return optim.gather_full_optim_state_dict(self.owner, optim_like, recipient_rank=recipient_rank)

    def get_shard_from_optim_state_dict(
        self, full_optim_state_dict: dict[str, Any], optim_like: Optional[torch.optim.Optimizer]
    ) -> dict[str, Any]:
        """This rank's part of a full optimizer state dict."""
        return optim.get_shard_from_optim_state_dict(self.owner, full_optim_state_dict, optim=optim_like)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Per original parameter a row-sharded DTensor; every rank calls it."""
        self._every_rank_calls("sharded_state_dict()")
        return sharded.sharded_state_dict(self.owner)

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any], strict: bool) -> IncompatibleKeys:
        """Load what ``torch.distributed.checkpoint.load`` filled in; every rank calls it."""
        self._every_rank_calls("load_sharded_state_dict()")
        return sharded.load_sharded_state_dict(self.owner, state_dict, strict=strict)

    def load_from_state_dict_hook(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """The owner's part when an *unwrapped* parent's ``load_state_dict`` recurses into it (auto_wrap case)."""
        full.load_from_state_dict_hook(self.owner, state_dict, prefix, *args)


_STATE_DICT_ARGS = ("destination", "prefix", "keep_vars")


def _state_dict_arguments(
    method: str, args: tuple[Any, ...], kwargs: dict[str, Any], positional: bool = True
) -> dict[str, Any]:
    """``nn.Module.state_dict``'s arguments as a keyword dict: by keyword, or (``positional``) also in its order."""
    if args and not positional:
        raise TypeError(f"{method}() takes keyword arguments only (destination=, prefix=, keep_vars=)")
    unknown = sorted(set(kwargs) - set(_STATE_DICT_ARGS))
    if unknown or len(args) > len(_STATE_DICT_ARGS):
        got = f"unexpected keyword arguments {unknown}" if unknown else f"{len(args)} positional arguments"
        raise TypeError(f"{method}() got {got}; it takes nn.Module.state_dict's destination, prefix, keep_vars")
    given = dict(zip(_STATE_DICT_ARGS, args))
    twice = sorted(set(given) & set(kwargs))
    if twice:
        raise TypeError(f"{method}() got {twice} both by position and by keyword; pass each once")
    return {**given, **kwargs}
