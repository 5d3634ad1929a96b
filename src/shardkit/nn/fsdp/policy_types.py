"""The frozen policies that hold a :class:`FullyShardedDataParallel` unit's settings, and the option types users pass.

Each dataclass checks its own invariants in ``__post_init__``, so no invalid policy can be built (also not by
``dataclasses.replace``); the runtime only ever reads these. The constructor's flat, fairscale-style arguments are
turned into them by :func:`shardkit.nn.fsdp.policies.policies_from_args`; import both from
:mod:`shardkit.nn.fsdp.policies`, which re-exports everything here. Example::

    policies = FSDPPolicies(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    dataclasses.replace(policies.reduce, predivide_factor=0)   # raises: the factor must be > 0
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

from shardkit.nn.fsdp.strategy import ShardingStrategy

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
    #: torch FSDP's name for what is sharded where (see :class:`ShardingStrategy`); it agrees with
    #: ``reshard_after_forward`` (``NO_SHARD`` with either: one rank per shard group has nothing to free).
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD

    def __post_init__(self) -> None:
        for name in ("reshard_after_forward", "flatten_parameters", "disable_reshard_on_root"):
            _check_bool(f"ShardingPolicy.{name}", getattr(self, name))
        if not isinstance(self.strategy, ShardingStrategy):
            raise TypeError(f"ShardingPolicy.strategy must be a ShardingStrategy, got {self.strategy!r}")
        if self.strategy is not ShardingStrategy.NO_SHARD and (
            self.strategy.reshards_after_forward != self.reshard_after_forward
        ):
            raise ValueError(
                f"ShardingPolicy(strategy={self.strategy.name}, reshard_after_forward={self.reshard_after_forward}) "
                "contradict each other: FULL_SHARD and HYBRID_SHARD reshard after forward, SHARD_GRAD_OP and "
                "_HYBRID_SHARD_ZERO2 do not"
            )


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

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            check_dtype(f"MixedPrecisionPolicy.{name}", getattr(self, name))
        _check_bool("MixedPrecisionPolicy.force_input_to_fp32", self.force_input_to_fp32)
        _check_bool("MixedPrecisionPolicy.clear_autocast_cache", self.clear_autocast_cache)
        if self.reduce_dtype is not None and not self.enabled:
            raise ValueError(
                f"MixedPrecisionPolicy(reduce_dtype={self.reduce_dtype}) needs a 16-bit param_dtype: without mixed "
                "precision gradients are reduced in their own dtype; leave reduce_dtype None"
            )
        if self.force_input_to_fp32 and self.enabled:
            raise ValueError(
                "MixedPrecisionPolicy(force_input_to_fp32=True) applies to full precision only: under mixed "
                f"precision inputs are cast to param_dtype ({self.param_dtype}); leave it False"
            )

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

    def __post_init__(self) -> None:
        _check_bool("OffloadPolicy.offload_params", self.offload_params)
        _check_device("OffloadPolicy.compute_device", self.compute_device)


@dataclass(frozen=True)
class PrefetchPolicy:
    """Prefetch hints; they change when communication is issued, never the results."""

    #: When backward starts gathering the next unit (None: each unit gathers when it starts).
    backward: Optional[BackwardPrefetch] = None
    #: From the second step on, a unit's forward starts gathering the next unit (previous forward's order).
    forward: bool = False

    def __post_init__(self) -> None:
        if self.backward is not None and not isinstance(self.backward, BackwardPrefetch):
            raise TypeError(f"backward_prefetch must be a BackwardPrefetch or None, got {self.backward!r}")
        _check_bool("PrefetchPolicy.forward", self.forward)


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
    #: Hybrid sharding and NO_SHARD: after the reduce-scatter over the shard group, each gradient shard is
    #: all-reduced over this group (the unit's replicas: same local rank on the other nodes). None: no replicas.
    replica_group: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.group, ProcessGroupName) and not is_group(self.group):
            raise TypeError(
                f"ReducePolicy.group must be a ProcessGroupName or a process group, got {type(self.group).__name__}"
            )
        for name in ("predivide_factor", "postdivide_factor"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"ReducePolicy.{name} must be a number > 0 (or None), got {value!r}")
        if self.postdivide_factor is not None and self.predivide_factor is None:
            raise ValueError("ReducePolicy.postdivide_factor needs predivide_factor: the two are set together")
        if self.replica_group is not None and not is_group(self.replica_group):
            raise TypeError(
                f"ReducePolicy.replica_group must be a process group or None, got {type(self.replica_group).__name__}"
            )

    def divide_factors(self, world_size: int) -> Optional[tuple[float, float]]:
        """``(before, after)`` the reduction, or None to let shardkit choose (the result is the average)."""
        if self.predivide_factor is None:
            return None
        post = self.postdivide_factor
        return self.predivide_factor, (world_size / self.predivide_factor if post is None else post)


@dataclass(frozen=True)
class StateDictPolicy:
    """Where full state dicts are materialised (None: the compute device), and by whom."""

    #: Device full state dicts are materialised on (None: where the parameters are).
    device: Optional[torch.device] = None
    #: Only global rank 0 keeps the full state dict; every rank still takes part in the gathers.
    rank0_only: bool = False
    #: ``gather_full_optim_state_dict`` skips this unit's optimizer state (the recipient's own state is used).
    no_broadcast_optim_state: bool = False

    def __post_init__(self) -> None:
        _check_device("StateDictPolicy.device", self.device)
        _check_bool("StateDictPolicy.rank0_only", self.rank0_only)
        _check_bool("StateDictPolicy.no_broadcast_optim_state", self.no_broadcast_optim_state)


@dataclass(frozen=True)
class FSDPPolicies:
    """Every setting of one wrapped unit."""

    #: How parameters are split and when full copies are freed.
    sharding: ShardingPolicy = field(default_factory=ShardingPolicy)
    #: Compute, reduce and buffer dtypes.
    mixed_precision: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    #: Where shards live and computation runs.
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    #: Prefetch hints.
    prefetch: PrefetchPolicy = field(default_factory=PrefetchPolicy)
    #: Where and by whom full state dicts are materialised.
    state_dict: StateDictPolicy = field(default_factory=StateDictPolicy)
    #: Reduce-scatter group and averaging factors.
    reduce: ReducePolicy = field(default_factory=ReducePolicy)
    #: Reserved for bucketing reduce-scatters across units (accepted for fairscale compatibility; <= 0: none).
    bucket_cap_mb: float = 25.0
    #: ``repr`` shows every setting.
    verbose: bool = False
    #: ``reset_parameters()`` re-initialises the wrapped module (with its full parameters) instead of raising.
    allow_reset_parameters: bool = False

    def __post_init__(self) -> None:
        for policy in fields(self):
            kind = policy.default_factory  # each policy field defaults to a fresh instance of its class
            if isinstance(kind, type) and not isinstance(getattr(self, policy.name), kind):
                raise TypeError(
                    f"FSDPPolicies.{policy.name} must be a {kind.__name__}, got {getattr(self, policy.name)!r}"
                )
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)):
            raise TypeError(
                f"bucket_cap_mb must be a number of megabytes (<= 0: no bucketing), got {self.bucket_cap_mb!r}"
            )
        _check_bool("FSDPPolicies.verbose", self.verbose)
        _check_bool("FSDPPolicies.allow_reset_parameters", self.allow_reset_parameters)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _check_device(name: str, device: Any) -> None:
    if device is not None and not isinstance(device, torch.device):
        raise TypeError(f"{name} must be a torch.device or None, got {device!r}")


def is_group(value: Any) -> bool:
    """A torch process group, or anything that answers rank() and size() (a DummyProcessGroup)."""
    return isinstance(value, torch.distributed.ProcessGroup) or (
        callable(getattr(value, "rank", None)) and callable(getattr(value, "size", None))
    )


def check_dtype(name: str, dtype: Optional[torch.dtype]) -> None:
    """Raise, naming the setting ``name``, unless ``dtype`` is None or one of :data:`COMPUTE_DTYPES`."""
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{name}={dtype} is not supported; use torch.float16, torch.bfloat16 or torch.float32")
