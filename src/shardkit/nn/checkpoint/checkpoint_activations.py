"""Compatibility path for ``fairscale.nn.checkpoint.checkpoint_activations``: the wrapper and the checkpointing flags
(see :mod:`shardkit.compat`).

Code written for fairscale imports from here unchanged::

    from shardkit.nn.checkpoint.checkpoint_activations import checkpoint_wrapper, disable_checkpointing

The implementations live in :mod:`shardkit.nn.checkpoint.wrapper` and :mod:`shardkit.nn.checkpoint.flags`.
One difference from fairscale: ``checkpoint_wrapper`` returns a :class:`CheckpointWrapper` module around the
given module instead of patching the module's ``forward`` in place; attribute access, ``state_dict`` keys and
parameter names are those of the wrapped module.
"""

from shardkit.nn.checkpoint.flags import (
    disable_checkpointing,
    enable_checkpointing,
    enable_recomputing,
    is_checkpointing,
    is_checkpointing_disabled,
    is_recomputing,
)
from shardkit.nn.checkpoint.wrapper import CheckpointWrapper, checkpoint_wrapper

__all__ = [
    "CheckpointWrapper",
    "checkpoint_wrapper",
    "disable_checkpointing",
    "enable_checkpointing",
    "enable_recomputing",
    "is_checkpointing",
    "is_checkpointing_disabled",
    "is_recomputing",
]
