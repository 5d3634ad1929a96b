"""Objects that exist only for fairscale's API: they translate fairscale's spellings onto shardkit's core.

Nothing in shardkit's core imports this module; the compatibility paths (:data:`shardkit.compat.COMPAT_PATHS`)
re-export from it.

``FlattenParamsWrapper`` and ``FlatParameter`` (``fairscale.nn.misc``): for ``isinstance`` checks only. Code
written for fairscale asks ``isinstance(fsdp._fsdp_wrapped_module, FlattenParamsWrapper)`` before reading the
user's module inside (VISSL), and ``isinstance(p, FlatParameter)`` to check that an optimizer was built from a
wrapped model's flat parameters (Lightning 1.x). Both checks answer here as there: a
:class:`~shardkit.nn.fsdp.FullyShardedDataParallel` unit's ``.module`` (with ``flatten_parameters``) is a
``FlattenParamsWrapper`` whose ``.module`` and ``._fpw_module`` are the user's module, and its shards are
``FlatParameter`` s. Neither class is constructed by users in shardkit: FSDP flattens inside its own parameter
groups; to flatten a module's parameters, wrap it in ``FullyShardedDataParallel``.

``fsdp_optim_utils`` (``fairscale.nn.data_parallel.fsdp_optim_utils``): only :func:`is_singleton_tensor` carries
over. fairscale's other helpers convert between its flat optimizer state and the unflattened one through its own
layout (``param_id_map``, per-rank padding lists and ``FlattenParamsWrapper`` views), which shardkit does not
have; their work is done by the wrapper's methods, which call them for you in fairscale too:

=====================================  ==========================================================================
fairscale helper                       shardkit
=====================================  ==========================================================================
``build_unflat_state_dict``            ``FullyShardedDataParallel.gather_full_optim_state_dict(optim)``
``flatten_optim_state_dict``           ``FullyShardedDataParallel.get_shard_from_optim_state_dict(full_osd)``
``check_param_counts_before_sharding`` done inside ``get_shard_from_optim_state_dict`` (parameters are matched by
                                       name, so a mismatch names the parameters)
=====================================  ==========================================================================

Calling one of those three raises an error that names its replacement.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import nn

from shardkit.nn.fsdp.module_view import is_view
from shardkit.utils.tensors import FLAT_SHARD_MARK

# ---------------------------------------------------------------------------------------- fairscale.nn.misc


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


# ------------------------------------------------------------- fairscale.nn.data_parallel.fsdp_optim_utils


def is_singleton_tensor(x: Any) -> bool:
    """True for a tensor with no dimensions (such as Adam's ``step`` in recent torch releases)."""
    return isinstance(x, torch.Tensor) and x.dim() == 0


def _replaced(name: str, replacement: str) -> NoReturn:
    raise NotImplementedError(
        f"fsdp_optim_utils.{name} works on fairscale's flat optimizer-state layout, which shardkit does not use; "
        f"call {replacement} instead"
    )


def build_unflat_state_dict(
    instance_list: Any,
    world_pad_info: Any,
    state: Any,
    singleton_state: Any,
    uncollected_opt_state: Any,
    original_sd: Any,
) -> NoReturn:
    """Replaced by ``FullyShardedDataParallel.gather_full_optim_state_dict`` (see the module docstring)."""
    _replaced("build_unflat_state_dict", "model.gather_full_optim_state_dict(optim)")


def flatten_optim_state_dict(sd: Any) -> NoReturn:
    """Replaced by ``FullyShardedDataParallel.get_shard_from_optim_state_dict`` (see the module docstring)."""
    _replaced("flatten_optim_state_dict", "model.get_shard_from_optim_state_dict(full_optim_state_dict)")


def check_param_counts_before_sharding(full_optim_state_dict: Any, n_instances: int) -> NoReturn:
    """Done inside ``FullyShardedDataParallel.get_shard_from_optim_state_dict`` (see the module docstring)."""
    _replaced("check_param_counts_before_sharding", "model.get_shard_from_optim_state_dict(full_optim_state_dict)")


__all__ = [
    "FlatParameter",
    "FlattenParamsWrapper",
    "build_unflat_state_dict",
    "check_param_counts_before_sharding",
    "flatten_optim_state_dict",
    "is_singleton_tensor",
]
