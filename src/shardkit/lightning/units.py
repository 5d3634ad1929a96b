"""The FSDP unit the fully sharded strategy builds: activation checkpointing first, then sharding."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from shardkit.nn.checkpoint import CheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper
from shardkit.nn.fsdp import FullyShardedDataParallel


def _not_a_unit(module: nn.Module) -> bool:
    return not isinstance(module, FullyShardedDataParallel)


class CheckpointedShardUnit(FullyShardedDataParallel):
    """A :class:`~shardkit.nn.FullyShardedDataParallel` unit that first checkpoints the blocks it will own.

    Checkpointing has to happen before sharding (the unit then gathers parameters for the recomputation like
    for any backward), and after the wrap policy looked at the model (so policies by block class still see
    the block class). Building units through this class does both, whether a unit comes from
    ``auto_wrap``, from ``wrap`` inside ``configure_model``, or is the root. Blocks inside units that already
    exist are left to those units.

    Args:
        module: what the unit will own.
        checkpoint_on: predicate choosing the modules to checkpoint (``module`` itself included); None for none.
        checkpoint_offload: keep the checkpointed modules' saved inputs in host memory.
        **fsdp_kwargs: the FullyShardedDataParallel arguments.
    """

    def __init__(
        self,
        module: nn.Module,
        checkpoint_on: Optional[Callable[[nn.Module], bool]] = None,
        checkpoint_offload: bool = False,
        **fsdp_kwargs: Any,
    ) -> None:
        if checkpoint_on is not None and not isinstance(module, CheckpointWrapper):
            if checkpoint_on(module):
                module = checkpoint_wrapper(module, offload_to_cpu=checkpoint_offload)
            else:
                apply_activation_checkpointing(
                    module, checkpoint_on, offload_to_cpu=checkpoint_offload, descend=_not_a_unit
                )
        super().__init__(module, **fsdp_kwargs)
