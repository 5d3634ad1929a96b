"""Activation checkpointing that composes with sharding.

``checkpoint_wrapper(module)`` recomputes the module's forward during backward instead of storing its
activations; ``apply_activation_checkpointing(model, BlockClass)`` does it for every block of a model.
``is_recomputing()`` tells a module's forward that it is being recomputed (to skip side effects), and
``disable_checkpointing()`` makes wrapped modules run a plain forward. fairscale's module path
``shardkit.nn.checkpoint.checkpoint_activations`` holds the same names.

Example::

    from shardkit.nn import FullyShardedDataParallel, checkpoint_wrapper

    blocks = [FullyShardedDataParallel(checkpoint_wrapper(Block(cfg))) for _ in range(n_layers)]
"""

from shardkit.nn.checkpoint.apply import apply_activation_checkpointing, module_matcher
from shardkit.nn.checkpoint.flags import (
    disable_checkpointing,
    enable_checkpointing,
    enable_recomputing,
    is_checkpointing,
    is_checkpointing_disabled,
    is_recomputing,
)
from shardkit.nn.checkpoint.wrapper import CheckpointWrapper, adds_no_name, checkpoint_wrapper

__all__ = [
    "CheckpointWrapper",
    "adds_no_name",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "disable_checkpointing",
    "enable_checkpointing",
    "enable_recomputing",
    "is_checkpointing",
    "is_checkpointing_disabled",
    "is_recomputing",
    "module_matcher",
]
