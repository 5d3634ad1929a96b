"""Settings of a :class:`FullyShardedDataParallel` unit, grouped in small frozen policies.

The public constructor keeps fairscale's flat argument list so users migrate by changing an import;
:func:`policies_from_args` validates those arguments once and turns them into the dataclasses below. The
runtime only ever reads these policies.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Union

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


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the copies used for computation; FP32 master shards are kept either way."""

    #: Dtype full parameters are gathered in and forward/backward runs in (None: the parameters' own dtype).
    param_dtype: Optional[torch.dtype] = None
    #: Dtype gradients are reduce-scattered in (None: the gradient's dtype, i.e. ``param_dtype``).
    reduce_dtype: Optional[torch.dtype] = None
    #: Dtype floating-point buffers are cast to at the root's first forward (None: left as they are).
    buffer_dtype: Optional[torch.dtype] = None

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
class StateDictPolicy:
    """Where full state dicts are materialised (None: the compute device)."""

    device: Optional[torch.device] = None


@dataclass(frozen=True)
class FSDPPolicies:
    """Every setting of one wrapped unit."""

    sharding: ShardingPolicy = field(default_factory=ShardingPolicy)
    mixed_precision: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    prefetch: PrefetchPolicy = field(default_factory=PrefetchPolicy)
    state_dict: StateDictPolicy = field(default_factory=StateDictPolicy)
    #: Reserved for bucketing reduce-scatters across units (accepted for fairscale compatibility).
    bucket_cap_mb: float = 25.0


def _check_dtype(name: str, dtype: Optional[torch.dtype]) -> None:
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{name}={dtype} is not supported; use torch.float16, torch.bfloat16 or torch.float32")


def _mixed_precision(
    mixed_precision: bool,
    compute_dtype: Optional[torch.dtype],
    buffer_dtype: Optional[torch.dtype],
    fp32_reduce_scatter: bool,
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
    )


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
    cpu_offload: Optional[CPUOffload],
    compute_device: Optional[Union[torch.device, str, int]],
    backward_prefetch: Optional[BackwardPrefetch],
    forward_prefetch: bool,
    bucket_cap_mb: float,
    state_dict_device: Optional[Union[torch.device, str]],
) -> FSDPPolicies:
    """Validate the documented constructor arguments and group them into :class:`FSDPPolicies`."""
    offload = move_params_to_cpu or (cpu_offload is not None and cpu_offload.offload_params)
    if move_grads_to_cpu is not None and move_grads_to_cpu != offload:
        raise ValueError(
            f"move_grads_to_cpu={move_grads_to_cpu} with parameter offload {'on' if offload else 'off'}: gradients "
            "must live on the same device as their parameter shards, so leave move_grads_to_cpu unset"
        )
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(f"backward_prefetch must be a BackwardPrefetch or None, got {backward_prefetch!r}")
    if bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
    device = torch.device(compute_device) if compute_device is not None else None
    return FSDPPolicies(
        sharding=ShardingPolicy(bool(reshard_after_forward), bool(flatten_parameters)),
        mixed_precision=_mixed_precision(mixed_precision, compute_dtype, buffer_dtype, fp32_reduce_scatter),
        offload=OffloadPolicy(offload_params=offload, compute_device=device),
        prefetch=PrefetchPolicy(backward=backward_prefetch, forward=bool(forward_prefetch)),
        state_dict=StateDictPolicy(torch.device(state_dict_device) if state_dict_device is not None else None),
        bucket_cap_mb=float(bucket_cap_mb),
    )
