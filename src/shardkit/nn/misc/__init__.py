"""Compatibility path for ``fairscale.nn.misc``: ``checkpoint_wrapper`` (fairscale's deprecated alias of
``fairscale.nn.checkpoint.checkpoint_wrapper``), and ``FlattenParamsWrapper`` / ``FlatParameter`` for ``isinstance``
checks (see :mod:`shardkit.compat.fairscale`).

Not offered: ``ParamBucket`` and ``GradBucket``, and building a ``FlattenParamsWrapper`` yourself: they were
building blocks of fairscale's FSDP and OSS. shardkit's FSDP flattens parameters inside its own parameter groups and
keeps the original parameter names in every state dict, and OSS keeps its own buckets, so neither needs a
user-facing flattening wrapper; to flatten a module's parameters for sharding, wrap it in
:class:`shardkit.nn.FullyShardedDataParallel`.
"""

from shardkit.compat.fairscale import FlatParameter, FlattenParamsWrapper
from shardkit.nn.checkpoint.wrapper import checkpoint_wrapper

__all__ = ["FlatParameter", "FlattenParamsWrapper", "checkpoint_wrapper"]
