"""Compatibility path for ``fairscale.nn.misc.flatten_params_wrapper``: ``FlattenParamsWrapper`` and
``FlatParameter``, for ``isinstance`` checks only (see :mod:`shardkit.compat.fairscale`)."""

from shardkit.compat.fairscale import FlatParameter, FlattenParamsWrapper

__all__ = ["FlatParameter", "FlattenParamsWrapper"]
