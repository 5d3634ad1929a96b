"""fairscale's ``fairscale.nn.misc`` path, for its public name that has a place in shardkit: ``checkpoint_wrapper``.

fairscale kept ``checkpoint_wrapper`` here as a deprecated alias of ``fairscale.nn.checkpoint.checkpoint_wrapper``;
so does shardkit (:func:`shardkit.nn.checkpoint.checkpoint_wrapper`).

Not offered: ``FlattenParamsWrapper``, ``ParamBucket`` and ``GradBucket`` were building blocks of fairscale's
FSDP and OSS. shardkit's FSDP flattens parameters inside its own parameter groups and keeps the original parameter
names in every state dict, and OSS keeps its own buckets, so neither needs a user-facing flattening wrapper; to
flatten a module's parameters for sharding, wrap it in :class:`shardkit.nn.FullyShardedDataParallel`.
"""

from shardkit.nn.checkpoint.wrapper import checkpoint_wrapper

__all__ = ["checkpoint_wrapper"]
