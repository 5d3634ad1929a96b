"""Activation checkpointing that composes with sharding.

``checkpoint_wrapper(module)`` recomputes the module's forward during backward instead of storing its
activations; ``apply_activation_checkpointing(model, BlockClass)`` does it for every block of a model.

Example::

    from shardkit.nn import FullyShardedDataParallel, checkpoint_wrapper

    blocks = [FullyShardedDataParallel(checkpoint_wrapper(Block(cfg))) for _ in range(n_layers)]
"""

from shardkit.nn.checkpoint.apply import apply_activation_checkpointing, module_matcher
from shardkit.nn.checkpoint.wrapper import CheckpointWrapper, adds_no_name, checkpoint_wrapper

__all__ = [
    "CheckpointWrapper",
    "adds_no_name",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "module_matcher",
]
