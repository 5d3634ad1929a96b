"""Compatibility path for ``fairscale.nn.data_parallel.fsdp_optim_utils``: ``is_singleton_tensor``, and the
three flat-layout helpers, which raise naming the FSDP method that replaces each (see
:mod:`shardkit.compat.fairscale`)."""

from shardkit.compat.fairscale import (
    build_unflat_state_dict,
    check_param_counts_before_sharding,
    flatten_optim_state_dict,
    is_singleton_tensor,
)

__all__ = [
    "build_unflat_state_dict",
    "check_param_counts_before_sharding",
    "flatten_optim_state_dict",
    "is_singleton_tensor",
]
