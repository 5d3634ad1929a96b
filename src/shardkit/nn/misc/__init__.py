"""fairscale's ``fairscale.nn.misc`` path: ``checkpoint_wrapper``, and ``FlattenParamsWrapper`` for ``isinstance``.

fairscale kept ``checkpoint_wrapper`` here as a deprecated alias of ``fairscale.nn.checkpoint.checkpoint_wrapper``;
so does shardkit (:func:`shardkit.nn.checkpoint.checkpoint_wrapper`).

``FlattenParamsWrapper`` (also under ``.flatten_params_wrapper``, with ``FlatParameter``) answers ``isinstance``
checks on a unit's ``.module`` as fairscale's does, and cannot be constructed (see
:mod:`shardkit.nn.misc.flatten_params_wrapper`). Not offered: ``ParamBucket`` and ``GradBucket``, and building a
``FlattenParamsWrapper`` yourself: they were building blocks of fairscale's FSDP and OSS. shardkit's FSDP
flattens parameters inside its own parameter groups and keeps the original parameter names in every state dict,
and OSS keeps its own buckets, so neither needs a user-facing flattening wrapper; to flatten a module's parameters
for sharding, wrap it in :class:`shardkit.nn.FullyShardedDataParallel`.
"""

from shardkit.nn.checkpoint.wrapper import checkpoint_wrapper
from shardkit.nn.misc.flatten_params_wrapper import FlatParameter, FlattenParamsWrapper

__all__ = ["FlatParameter", "FlattenParamsWrapper", "checkpoint_wrapper"]
