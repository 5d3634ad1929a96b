"""fairscale's ``fairscale.nn.misc.flatten_params_wrapper`` path, for ``isinstance`` checks only.

Code written for fairscale asks ``isinstance(fsdp._fsdp_wrapped_module, FlattenParamsWrapper)`` before reading
the user's module inside (VISSL), and ``isinstance(p, FlatParameter)`` to check that an optimizer was built from
a wrapped model's flat parameters (Lightning 1.x). Both checks answer here as there: a
:class:`~shardkit.nn.fsdp.FullyShardedDataParallel` unit's ``.module`` (with ``flatten_parameters``) is a
``FlattenParamsWrapper`` whose ``.module`` and ``._fpw_module`` are the user's module, and its shards are
``FlatParameter`` s. Neither class is constructed by users in shardkit: FSDP flattens inside its own parameter
groups; to flatten a module's parameters, wrap it in ``FullyShardedDataParallel``.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn

from shardkit.nn.fsdp.handle import FLAT_SHARD_MARK
from shardkit.nn.fsdp.module_view import is_view


class _FlattenParamsWrapperType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return is_view(obj)


class FlattenParamsWrapper(metaclass=_FlattenParamsWrapperType):
    """``isinstance(x, FlattenParamsWrapper)`` is True for ``fsdp.module`` of a unit that flattens parameters."""

    def __init__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            "shardkit does not build FlattenParamsWrapper on its own: FullyShardedDataParallel flattens parameters "
            "inside its units; wrap the module in shardkit.nn.FullyShardedDataParallel instead"
        )


class _FlatParameterType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, nn.Parameter) and bool(getattr(obj, FLAT_SHARD_MARK, False))


class FlatParameter(metaclass=_FlatParameterType):
    """``isinstance(p, FlatParameter)`` is True for the flat shards of FullyShardedDataParallel units."""

    def __init__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            "shardkit does not build FlatParameter on its own: FullyShardedDataParallel creates its flat shards; "
            "wrap the module in shardkit.nn.FullyShardedDataParallel and use model.parameters()"
        )


__all__ = ["FlatParameter", "FlattenParamsWrapper"]
