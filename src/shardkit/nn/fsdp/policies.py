"""Settings of a :class:`FullyShardedDataParallel` unit, grouped in small frozen policies.

The public constructor keeps fairscale's flat argument list so users migrate by changing an import;
:func:`policies_from_args` validates those arguments once (errors name the argument) and turns them into the
dataclasses of :mod:`shardkit.nn.fsdp.policy_types` (re-exported here), which check their own invariants in
``__post_init__`` (so no invalid policy can be built, also not by ``dataclasses.replace``). The runtime only ever
reads these policies. Each policy's builder below takes the constructor arguments it reads as parameters of the
same names, so a flag is spelled in the signature and in its builder only; fairscale's read-only attributes read
the policies back through :class:`~shardkit.nn.fsdp.unit_module.PolicySetting`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch

from shardkit.nn.fsdp.policy_types import (
    COMPUTE_DTYPES,
    BackwardPrefetch,
    CPUOffload,
    FSDPPolicies,
    MixedPrecisionPolicy,
    OffloadPolicy,
    PrefetchPolicy,
    ProcessGroupName,
    ReducePolicy,
    ShardingPolicy,
    StateDictPolicy,
    check_dtype,
    is_group,
)
from shardkit.nn.fsdp.strategy import ShardingStrategy

__all__ = [
    "COMPUTE_DTYPES",
    "POLICY_ARGUMENTS",
    "BackwardPrefetch",
    "CPUOffload",
    "FSDPPolicies",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "PrefetchPolicy",
    "ProcessGroupName",
    "ReducePolicy",
    "ShardingPolicy",
    "ShardingStrategy",
    "StateDictPolicy",
    "policies_from_args",
    "reduce_group_choice",
]


def _mixed_precision(
    mixed_precision: bool,
    compute_dtype: Optional[torch.dtype],
    buffer_dtype: Optional[torch.dtype],
    fp32_reduce_scatter: bool,
    force_input_to_fp32: bool,
    clear_autocast_cache: bool,
) -> MixedPrecisionPolicy:
    check_dtype("compute_dtype", compute_dtype)
    check_dtype("buffer_dtype", buffer_dtype)
    if mixed_precision and compute_dtype == torch.float32:
        raise ValueError(
            "mixed_precision=True computes in a 16-bit dtype; pass compute_dtype=torch.float16 or torch.bfloat16, "
            "or mixed_precision=False for full precision"
        )
    param_dtype = compute_dtype if compute_dtype is not None else (torch.float16 if mixed_precision else None)
    enabled = param_dtype is not None and param_dtype != torch.float32
    if fp32_reduce_scatter and not enabled:
        raise ValueError("fp32_reduce_scatter=True only makes sense with mixed precision (mixed_precision=True)")
    return MixedPrecisionPolicy(
        param_dtype=param_dtype if enabled else None,
        reduce_dtype=torch.float32 if fp32_reduce_scatter else None,
        buffer_dtype=buffer_dtype if buffer_dtype is not None else (param_dtype if enabled else None),
        # Under mixed precision inputs are cast to the compute dtype instead (fairscale ignores it there too).
        force_input_to_fp32=bool(force_input_to_fp32) and not enabled,
        clear_autocast_cache=bool(clear_autocast_cache),
    )


def _offload(
    move_params_to_cpu: bool,
    move_grads_to_cpu: Optional[bool],
    cpu_offload: Union[bool, CPUOffload, None],
    compute_device: Optional[Union[torch.device, str, int]],
) -> OffloadPolicy:
    if cpu_offload is not None and not isinstance(cpu_offload, (bool, CPUOffload)):
        raise TypeError(
            f"cpu_offload must be a bool (fairscale's spelling) or a CPUOffload (torch's), got {cpu_offload!r}"
        )
    offload = bool(move_params_to_cpu) or bool(cpu_offload)
    if move_grads_to_cpu is not None and move_grads_to_cpu != offload:
        raise ValueError(
            f"move_grads_to_cpu={move_grads_to_cpu} with parameter offload {'on' if offload else 'off'}: gradients "
            "must live on the same device as their parameter shards, so leave move_grads_to_cpu unset"
        )
    device = torch.device(compute_device) if compute_device is not None else None
    return OffloadPolicy(offload_params=offload, compute_device=device)


def reduce_group_choice(value: Any) -> Any:
    """Validate ``process_group_reduce_scatter``: a :class:`ProcessGroupName` (or its string), or a group."""
    if isinstance(value, str):
        try:
            return ProcessGroupName(value)
        except ValueError:
            names = ", ".join(f"ProcessGroupName.{n.name}" for n in ProcessGroupName)
            raise ValueError(f"process_group_reduce_scatter={value!r} is not one of {names}") from None
    if value is None:
        return ProcessGroupName.default  # fairscale's dummy set-ups pass None: reduce on the parameter group
    if is_group(value):
        return value
    raise TypeError(
        f"process_group_reduce_scatter must be a ProcessGroupName or a process group, got {type(value).__name__}"
    )


def _reduce(
    process_group_reduce_scatter: Any, gradient_predivide_factor: Optional[float], replica_group: Any
) -> ReducePolicy:
    if gradient_predivide_factor is not None and not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be > 0 (or None), got {gradient_predivide_factor}")
    factor = float(gradient_predivide_factor) if gradient_predivide_factor is not None else None
    return ReducePolicy(
        group=reduce_group_choice(process_group_reduce_scatter), predivide_factor=factor, replica_group=replica_group
    )


def _sharding(
    reshard_after_forward: bool,
    flatten_parameters: bool,
    disable_reshard_on_root: bool,
    sharding_strategy: Optional[ShardingStrategy],
) -> ShardingPolicy:
    """fairscale's ``reshard_after_forward`` and torch's ``sharding_strategy`` as one policy.

    ``reshard_after_forward`` defaults to True in fairscale's signature, so a True beside SHARD_GRAD_OP cannot be
    told from the default: the strategy decides. An explicit False beside a strategy that reshards is a conflict.
    """
    reshard, strategy = bool(reshard_after_forward), sharding_strategy
    if strategy is None:
        strategy = ShardingStrategy.FULL_SHARD if reshard else ShardingStrategy.SHARD_GRAD_OP
    elif not isinstance(strategy, ShardingStrategy):
        names = ", ".join(f"ShardingStrategy.{s.name}" for s in ShardingStrategy)
        raise TypeError(f"sharding_strategy must be one of {names} (or None), got {strategy!r}")
    elif strategy is not ShardingStrategy.NO_SHARD:
        if not reshard and strategy.reshards_after_forward:
            raise ValueError(
                f"reshard_after_forward=False contradicts sharding_strategy=ShardingStrategy.{strategy.name}, which "
                "frees full parameters after forward; pass only one of them (SHARD_GRAD_OP or _HYBRID_SHARD_ZERO2 "
                "keep them until backward)"
            )
        reshard = strategy.reshards_after_forward
    return ShardingPolicy(reshard, bool(flatten_parameters), bool(disable_reshard_on_root), strategy)


def _prefetch(backward_prefetch: Optional[BackwardPrefetch], forward_prefetch: bool) -> PrefetchPolicy:
    return PrefetchPolicy(backward=backward_prefetch, forward=bool(forward_prefetch))


def _bucket_cap_mb(bucket_cap_mb: float) -> float:
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"bucket_cap_mb must be a number of megabytes (<= 0: no bucketing), got {bucket_cap_mb!r}")
    return float(bucket_cap_mb)


def _state_dict(
    state_dict_device: Optional[Union[torch.device, str]],
    state_dict_on_rank_0_only: bool,
    no_broadcast_optim_state: bool,
) -> StateDictPolicy:
    return StateDictPolicy(
        torch.device(state_dict_device) if state_dict_device is not None else None,
        rank0_only=bool(state_dict_on_rank_0_only),
        no_broadcast_optim_state=bool(no_broadcast_optim_state),
    )


#: How each field of :class:`FSDPPolicies` is built, in the order arguments are checked. A builder's parameters
#: are the constructor arguments it reads, by name: the one place besides the signature that names a flag.
_BUILDERS: dict[str, Callable[..., Any]] = {
    "prefetch": _prefetch,
    "bucket_cap_mb": _bucket_cap_mb,
    "sharding": _sharding,
    "mixed_precision": _mixed_precision,
    "offload": _offload,
    "state_dict": _state_dict,
    "reduce": _reduce,
    "verbose": lambda verbose: bool(verbose),
    "allow_reset_parameters": lambda allow_reset_parameters: bool(allow_reset_parameters),
}


@functools.cache
def _reads(builder: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(builder).parameters)


#: Every argument some builder reads (``replica_group`` is not the user's: the constructor resolves it).
POLICY_ARGUMENTS: frozenset[str] = frozenset(name for builder in _BUILDERS.values() for name in _reads(builder))


def policies_from_args(arguments: Mapping[str, Any]) -> FSDPPolicies:
    """Validate the constructor's settings, given by argument name, and group them into :class:`FSDPPolicies`.

    ``arguments`` holds exactly :data:`POLICY_ARGUMENTS`: the constructor passes its own arguments (all but
    ``module`` and ``process_group``) and the ``replica_group`` it resolved (the group each reduced gradient shard
    is all-reduced over: hybrid sharding, NO_SHARD). A missing name, or one that no policy reads, is refused, so a
    flag added to the signature cannot be silently ignored. Example::

        policies = policies_from_args({**defaults, "mixed_precision": True})
    """
    missing, unread = POLICY_ARGUMENTS - set(arguments), set(arguments) - POLICY_ARGUMENTS
    if missing or unread:
        raise TypeError(
            f"policies_from_args: missing settings {sorted(missing)}, settings no policy reads {sorted(unread)}"
        )
    built = {
        field: builder(**{name: arguments[name] for name in _reads(builder)}) for field, builder in _BUILDERS.items()
    }
    return FSDPPolicies(**built)
