"""Settings of a :class:`FullyShardedDataParallel` unit, grouped in small frozen policies.

The public constructor keeps fairscale's flat argument list so users migrate by changing an import;
:func:`policies_from_args` validates those arguments once and turns them into the dataclasses below. The
runtime only ever reads these policies.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

#: Dtypes full parameters may be gathered in.
COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CPUOffload:
    """Keep parameter shards and their gradients in CPU memory between uses (torch's spelling).

    Full parameters are still gathered on the compute device for forward and backward; the optimizer then
    steps on CPU tensors. Example::

        model = FullyShardedDataParallel(model, cpu_offload=CPUOffload(offload_params=True))
    """

    offload_params: bool = False

    def __bool__(self) -> bool:
        # fairscale's ``cpu_offload`` is a bool: ``if model.cpu_offload:`` keeps its meaning.
        return self.offload_params


class ProcessGroupName(str, enum.Enum):
    """Where a unit reduce-scatters its gradients, when no process group object is given (fairscale's names).

    ``reduce_scatter`` (default): on a second process group over the same ranks, created at the root's first
    forward, so reductions never queue behind the all-gathers of the parameter group. ``default``: on the
    parameter group itself (one group fewer; reductions and gathers then share its queue).
    """

    default = "default"
    reduce_scatter = "reduce_scatter"


class BackwardPrefetch(enum.Enum):
    """When to start gathering the next unit's parameters during backward.

    ``BACKWARD_PRE`` issues the gather before the current unit's gradient computation (more overlap, one more
    unit's parameters in memory); ``BACKWARD_POST`` after it. Both only change timing, never results.
    """

    BACKWARD_PRE = "backward_pre"
    BACKWARD_POST = "backward_post"


@dataclass(frozen=True)
class ShardingPolicy:
    """How parameters are split and when full copies are freed."""

    #: Free full parameters after forward and gather them again for backward (saves memory, costs one
    #: all-gather per unit per step). The root unit keeps them, since its backward runs first.
    reshard_after_forward: bool = True
    #: Concatenate a unit's parameters (per dtype and requires_grad) into one flat tensor before sharding,
    #: so each unit issues one collective; False shards every parameter separately.
    flatten_parameters: bool = True
    #: The root keeps its full parameters after forward even with ``reshard_after_forward`` (its backward
    #: starts right away); False frees them too, for a root whose backward comes much later.
    disable_reshard_on_root: bool = True


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the copies used for computation; FP32 master shards are kept either way."""

    #: Dtype full parameters are gathered in and forward/backward runs in (None: the parameters' own dtype).
    param_dtype: Optional[torch.dtype] = None
    #: Dtype gradients are reduce-scattered in (None: the gradient's dtype, i.e. ``param_dtype``).
    reduce_dtype: Optional[torch.dtype] = None
    #: Dtype floating-point buffers are cast to at the root's first forward (None: left as they are).
    buffer_dtype: Optional[torch.dtype] = None
    #: Full precision only: cast float16 inputs of the unit to float32 (e.g. SyncBatchNorm under autocast).
    force_input_to_fp32: bool = False
    #: Call ``torch.clear_autocast_cache()`` after the unit's forward (autocast's cache of cast weights).
    clear_autocast_cache: bool = False

    @property
    def enabled(self) -> bool:
        """True when computation runs in a lower precision than the FP32 master shards."""
        return self.param_dtype is not None and self.param_dtype != torch.float32


@dataclass(frozen=True)
class OffloadPolicy:
    """Where shards live and where computation happens."""

    #: Shards and their gradients live on CPU; full parameters are gathered on ``compute_device``.
    offload_params: bool = False
    #: Device forward and backward run on (None: the device the parameters are on at wrap time).
    compute_device: Optional[torch.device] = None


@dataclass(frozen=True)
class PrefetchPolicy:
    """Prefetch hints; they change when communication is issued, never the results."""

    backward: Optional[BackwardPrefetch] = None
    forward: bool = False


@dataclass(frozen=True)
class ReducePolicy:
    """How gradients are reduced: the process group of the reduce-scatter and the averaging factors."""

    #: A :class:`ProcessGroupName`, or the process group to reduce-scatter on (same ranks as the parameters').
    group: Any = ProcessGroupName.reduce_scatter
    #: Divide gradients by this before the reduction (None: shardkit chooses, see
    #: :mod:`shardkit.nn.fsdp.reduce`); the rest of the average (``world_size / predivide``) is divided after.
    predivide_factor: Optional[float] = None
    #: Divide by this after the reduction (set together with ``predivide_factor``; None: ``world_size /
    #: predivide_factor``). Only ``set_gradient_divide_factors`` sets a pair that is not the average.
    postdivide_factor: Optional[float] = None

    def divide_factors(self, world_size: int) -> Optional[tuple[float, float]]:
        """``(before, after)`` the reduction, or None to let shardkit choose (the result is the average)."""
        if self.predivide_factor is None:
            return None
        post = self.postdivide_factor
        return self.predivide_factor, (world_size / self.predivide_factor if post is None else post)


@dataclass(frozen=True)
class StateDictPolicy:
    """Where full state dicts are materialised (None: the compute device), and by whom."""

    device: Optional[torch.device] = None
    #: Only global rank 0 keeps the full state dict; every rank still takes part in the gathers.
    rank0_only: bool = False
    #: ``gather_full_optim_state_dict`` skips this unit's optimizer state (the recipient's own state is used).
    no_broadcast_optim_state: bool = False


@dataclass(frozen=True)
class FSDPPolicies:
    """Every setting of one wrapped unit."""

    sharding: ShardingPolicy = field(default_factory=ShardingPolicy)
    mixed_precision: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    prefetch: PrefetchPolicy = field(default_factory=PrefetchPolicy)
    state_dict: StateDictPolicy = field(default_factory=StateDictPolicy)
    reduce: ReducePolicy = field(default_factory=ReducePolicy)
    #: Reserved for bucketing reduce-scatters across units (accepted for fairscale compatibility; <= 0: none).
    bucket_cap_mb: float = 25.0
    #: ``repr`` shows every setting.
    verbose: bool = False
    #: ``reset_parameters()`` re-initialises the wrapped module (with its full parameters) instead of raising.
    allow_reset_parameters: bool = False


def _check_dtype(name: str, dtype: Optional[torch.dtype]) -> None:
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{name}={dtype} is not supported; use torch.float16, torch.bfloat16 or torch.float32")


def _mixed_precision(
    mixed_precision: bool,
    compute_dtype: Optional[torch.dtype],
    buffer_dtype: Optional[torch.dtype],
    fp32_reduce_scatter: bool,
    force_input_to_fp32: bool,
    clear_autocast_cache: bool,
) -> MixedPrecisionPolicy:
    _check_dtype("compute_dtype", compute_dtype)
    _check_dtype("buffer_dtype", buffer_dtype)
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
    if isinstance(value, torch.distributed.ProcessGroup) or (
        callable(getattr(value, "rank", None)) and callable(getattr(value, "size", None))
    ):
        return value
    raise TypeError(
        f"process_group_reduce_scatter must be a ProcessGroupName or a process group, got {type(value).__name__}"
    )


def _reduce(process_group_reduce_scatter: Any, gradient_predivide_factor: Optional[float]) -> ReducePolicy:
    if gradient_predivide_factor is not None and not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be > 0 (or None), got {gradient_predivide_factor}")
    factor = float(gradient_predivide_factor) if gradient_predivide_factor is not None else None
    return ReducePolicy(group=reduce_group_choice(process_group_reduce_scatter), predivide_factor=factor)


def policies_from_args(
    *,
    reshard_after_forward: bool,
    flatten_parameters: bool,
    mixed_precision: bool,
    fp32_reduce_scatter: bool,
    compute_dtype: Optional[torch.dtype],
    buffer_dtype: Optional[torch.dtype],
    move_params_to_cpu: bool,
    move_grads_to_cpu: Optional[bool],
    cpu_offload: Union[bool, CPUOffload, None],
    compute_device: Optional[Union[torch.device, str, int]],
    backward_prefetch: Optional[BackwardPrefetch],
    forward_prefetch: bool,
    bucket_cap_mb: float,
    state_dict_device: Optional[Union[torch.device, str]],
    process_group_reduce_scatter: Any = ProcessGroupName.reduce_scatter,
    disable_reshard_on_root: bool = True,
    no_broadcast_optim_state: Optional[bool] = False,
    clear_autocast_cache: bool = False,
    force_input_to_fp32: bool = False,
    verbose: bool = False,
    state_dict_on_rank_0_only: bool = False,
    gradient_predivide_factor: Optional[float] = None,
    allow_reset_parameters: bool = False,
) -> FSDPPolicies:
    """Validate the documented constructor arguments and group them into :class:`FSDPPolicies`."""
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(f"backward_prefetch must be a BackwardPrefetch or None, got {backward_prefetch!r}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"bucket_cap_mb must be a number of megabytes (<= 0: no bucketing), got {bucket_cap_mb!r}")
    return FSDPPolicies(
        sharding=ShardingPolicy(bool(reshard_after_forward), bool(flatten_parameters), bool(disable_reshard_on_root)),
        mixed_precision=_mixed_precision(
            mixed_precision, compute_dtype, buffer_dtype, fp32_reduce_scatter, force_input_to_fp32, clear_autocast_cache
        ),
        offload=_offload(move_params_to_cpu, move_grads_to_cpu, cpu_offload, compute_device),
        prefetch=PrefetchPolicy(backward=backward_prefetch, forward=bool(forward_prefetch)),
        state_dict=StateDictPolicy(
            torch.device(state_dict_device) if state_dict_device is not None else None,
            rank0_only=bool(state_dict_on_rank_0_only),
            no_broadcast_optim_state=bool(no_broadcast_optim_state),
        ),
        reduce=_reduce(process_group_reduce_scatter, gradient_predivide_factor),
        bucket_cap_mb=float(bucket_cap_mb),
        verbose=bool(verbose),
        allow_reset_parameters=bool(allow_reset_parameters),
    )
