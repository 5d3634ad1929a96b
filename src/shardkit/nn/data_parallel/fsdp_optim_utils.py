"""Compatibility path for ``fairscale.nn.data_parallel.fsdp_optim_utils``.

Only :func:`is_singleton_tensor` carries over. fairscale's other helpers convert between its flat optimizer
state and the unflattened one through its own layout (``param_id_map``, per-rank padding lists and
``FlattenParamsWrapper`` views), which shardkit does not have; their work is done by the wrapper's methods,
which call them for you in fairscale too:

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
    "build_unflat_state_dict",
    "check_param_counts_before_sharding",
    "flatten_optim_state_dict",
    "is_singleton_tensor",
]
