"""The part of fairscale 0.4.13's ``FullyShardedDataParallel`` surface that has no other home: its settings read
back as attributes, gradient divide factors, ``reset_parameters``, the reduce-scatter group and the verbose repr.

Mixed into :class:`~shardkit.nn.fsdp.FullyShardedDataParallel`; everything here reads the unit's frozen
:class:`~shardkit.nn.fsdp.policies.FSDPPolicies`, and the only writer (:meth:`set_gradient_divide_factors`)
replaces them whole.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from shardkit.distributed.groups import GroupLike, group_size, is_dummy, resolve_group
from shardkit.nn.fsdp._collectives import create_reduce_channels
from shardkit.nn.fsdp.policies import BackwardPrefetch, CPUOffload, FSDPPolicies, ProcessGroupName
from shardkit.nn.fsdp.runtime import TrainingState, Unit

if TYPE_CHECKING:
    from shardkit.nn.fsdp.api import FullyShardedDataParallel


class FairscaleMethods:
    """fairscale's attributes and helper methods (mixed in before ``nn.Module``)."""

    # Set by FullyShardedDataParallel.__init__.
    _policies: FSDPPolicies
    _unit: Unit
    process_group: GroupLike
    world_size: int
    rank: int

    # ------------------------------------------------------------------ settings, as fairscale names them
    @property
    def mixed_precision(self) -> bool:
        return self._policies.mixed_precision.enabled

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        return self._policies.mixed_precision.param_dtype

    @property
    def buffer_dtype(self) -> Optional[torch.dtype]:
        return self._policies.mixed_precision.buffer_dtype

    @property
    def fp32_reduce_scatter(self) -> bool:
        return self._policies.mixed_precision.reduce_dtype == torch.float32

    @property
    def flatten_parameters(self) -> bool:
        return self._policies.sharding.flatten_parameters

    @property
    def reshard_after_forward(self) -> bool:
        return self._policies.sharding.reshard_after_forward

    @property
    def move_params_to_cpu(self) -> bool:
        return self._policies.offload.offload_params

    @property
    def cpu_offload(self) -> CPUOffload:
        return CPUOffload(offload_params=self._policies.offload.offload_params)

    @property
    def backward_prefetch(self) -> Optional[BackwardPrefetch]:
        return self._policies.prefetch.backward

    @property
    def forward_prefetch(self) -> bool:
        return self._policies.prefetch.forward

    @property
    def state_dict_device(self) -> Optional[torch.device]:
        return self._policies.state_dict.device

    @property
    def process_group_reduce_scatter(self) -> GroupLike:
        """The process group this unit's gradients are reduce-scattered on (before the root's first forward
        creates the separate channel, the parameter group, which holds the same ranks)."""
        choice = self._policies.reduce.group
        if isinstance(choice, ProcessGroupName):
            return self._unit.ctx.reduce_channel(self._unit.group.group)
        group: GroupLike = choice
        return group

    @property
    def disable_reshard_on_root(self) -> bool:
        return self._policies.sharding.disable_reshard_on_root

    @property
    def move_grads_to_cpu(self) -> bool:
        """Gradient shards live where the parameter shards do (CPU under offload)."""
        return self._policies.offload.offload_params

    @property
    def bucket_cap_mb(self) -> float:
        return self._policies.bucket_cap_mb

    @property
    def compute_device(self) -> Optional[torch.device]:
        """Where full parameters are gathered and forward/backward run (None for a unit without parameters and
        no ``compute_device`` argument)."""
        handles = self._unit.group.handles
        device = self._policies.offload.compute_device
        return device if device is not None or not handles else handles[0].compute_device

    @property
    def no_broadcast_optim_state(self) -> bool:
        """Set by the argument, or (as fairscale does) for a nested unit alone in its group under a bigger root:
        its state is already complete on each rank."""
        root = self._unit.root
        alone = self.world_size == 1 and root is not None and root.group.world_size > 1
        return self._policies.state_dict.no_broadcast_optim_state or alone

    @property
    def state_dict_on_rank_0_only(self) -> bool:
        return self._policies.state_dict.rank0_only

    @property
    def clear_autocast_cache(self) -> bool:
        return self._policies.mixed_precision.clear_autocast_cache

    @property
    def force_input_to_fp32(self) -> bool:
        return self._policies.mixed_precision.force_input_to_fp32

    @property
    def verbose(self) -> bool:
        return self._policies.verbose

    @property
    def allow_reset_parameters(self) -> bool:
        return self._policies.allow_reset_parameters

    @property
    def gradient_predivide_factor(self) -> float:
        """What gradients are divided by before the reduction (see :meth:`set_gradient_divide_factors`)."""
        return self._divide_factors()[0]

    @property
    def gradient_postdivide_factor(self) -> float:
        """What the reduced gradient shards are divided by."""
        return self._divide_factors()[1]

    def _divide_factors(self) -> tuple[float, float]:
        chosen = self._policies.reduce.divide_factors(self.world_size)
        if chosen is not None:
            return chosen
        # shardkit's own choice (shardkit.nn.fsdp.reduce): 16-bit sums are divided first, FP32 ones after.
        mp = self._policies.mixed_precision
        dtypes = {mp.reduce_dtype or h.compute_dtype for h in self._unit.group.handles}
        if dtypes - {torch.float32}:
            return float(self.world_size), 1.0
        return 1.0, float(self.world_size)

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """Divide gradients by ``pre`` before the reduction and by ``post`` after it (fairscale's API).

        ``pre * post == world_size`` keeps the average; any other pair scales every gradient by
        ``world_size / (pre * post)``. With ``recursive`` every nested unit gets the same factors. Only between
        steps.
        """
        if not (pre > 0 and post > 0):
            raise ValueError(f"set_gradient_divide_factors: factors must be > 0, got pre={pre}, post={post}")
        targets = [m for m in self._modules_tree() if isinstance(m, FairscaleMethods)] if recursive else [self]
        for unit in targets:
            unit._unit.assert_state(TrainingState.IDLE)
        for unit in targets:
            reduce = dataclasses.replace(
                unit._policies.reduce, predivide_factor=float(pre), postdivide_factor=float(post)
            )
            unit._replace_policies(dataclasses.replace(unit._policies, reduce=reduce))

    def _replace_policies(self, policies: FSDPPolicies) -> None:
        # Every layer holding the unit's policies sees the new object.
        self._policies = policies
        self._unit.policies = policies
        self._unit.group.policies = policies

    def _modules_tree(self) -> list[nn.Module]:
        assert isinstance(self, nn.Module)
        return list(self.modules())

    # ------------------------------------------------------------------ methods fairscale users call
    def reset_parameters(self) -> None:
        """Re-initialise the wrapped module (``module.reset_parameters()`` on its full parameters, written back
        to the shards). Only with ``allow_reset_parameters=True``: re-initialising after sharding gives
        different values than before wrapping (random streams differ), so fairscale makes it opt-in too."""
        if not self._policies.allow_reset_parameters:
            raise RuntimeError(
                "reset_parameters() after FullyShardedDataParallel wrapping is not allowed: initialise the module "
                "before wrapping, or pass allow_reset_parameters=True"
            )
        fsdp: Any = self
        with fsdp.summon_full_params(recurse=True):
            fsdp.module.reset_parameters()

    def assert_state(self, state: Union[TrainingState, list[TrainingState]]) -> None:
        """Raise an error naming this unit unless it is in ``state`` (or one of the states listed)."""
        states = state if isinstance(state, list) else [state]
        self._unit.assert_state(*states)

    def non_shared_params(self) -> list[nn.Parameter]:
        """This unit's own parameter shards (nested units' are not included)."""
        return [h.shard for h in self._unit.group.handles]

    @property
    def params_with_grad(self) -> list[nn.Parameter]:
        """Parameter shards of this unit and the units below it that have a gradient."""
        assert isinstance(self, nn.Module)
        return [p for p in self.parameters() if p.grad is not None]

    def append_shared_param(self, p: nn.Parameter) -> None:
        """Not supported: fairscale's experimental way to share one parameter between two units."""
        raise NotImplementedError(
            "append_shared_param is not supported: shardkit stores a tied parameter once, in the unit that holds "
            "every module using it; wrap the modules sharing the parameter in one FullyShardedDataParallel unit"
        )

    # ------------------------------------------------------------------ repr
    def _verbose_repr(self) -> str:
        p = self._policies
        return (
            f", rank={self.rank}, is_root={self._unit.is_root}, compute_dtype={p.mixed_precision.param_dtype}, "
            f"buffer_dtype={p.mixed_precision.buffer_dtype}, reduce_dtype={p.mixed_precision.reduce_dtype}, "
            f"compute_device={self.compute_device}, move_params_to_cpu={p.offload.offload_params}, "
            f"disable_reshard_on_root={p.sharding.disable_reshard_on_root}, "
            f"process_group_reduce_scatter={_choice_name(p.reduce.group)}, "
            f"gradient_divide_factors={self._divide_factors()}, bucket_cap_mb={p.bucket_cap_mb}, "
            f"clear_autocast_cache={p.mixed_precision.clear_autocast_cache}, "
            f"force_input_to_fp32={p.mixed_precision.force_input_to_fp32}, "
            f"backward_prefetch={p.prefetch.backward}, forward_prefetch={p.prefetch.forward}, "
            f"state_dict_on_rank_0_only={p.state_dict.rank0_only}"
        )

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _check_reduce_group(policies: FSDPPolicies, group: GroupLike) -> FSDPPolicies:
        """Resolve an explicit ``process_group_reduce_scatter`` against the parameter group ``group``."""
        choice = policies.reduce.group
        if isinstance(choice, ProcessGroupName):
            return policies
        choice = resolve_group(choice, "FullyShardedDataParallel(process_group_reduce_scatter=...)")
        size, world_size = group_size(choice), group_size(group)
        if size != world_size:
            # fairscale's behaviour: a group of another size cannot reduce-scatter these shards; use the
            # parameter group instead.
            warnings.warn(
                f"process_group_reduce_scatter has {size} ranks but process_group has {world_size}: gradients are "
                "reduce-scattered on process_group instead",
                stacklevel=4,
            )
            choice = ProcessGroupName.default
        elif world_size > 1 and is_dummy(choice) != is_dummy(group):
            raise ValueError(
                "process_group_reduce_scatter and process_group must both be real process groups or both "
                "DummyProcessGroups: a dummy group cannot reduce gradients of real ranks"
            )
        elif world_size > 1 and not is_dummy(group):
            ours = dist.get_process_group_ranks(group)  # type: ignore[arg-type]
            theirs = dist.get_process_group_ranks(choice)  # type: ignore[arg-type]
            if ours != theirs:
                raise ValueError(
                    f"process_group_reduce_scatter holds ranks {theirs} but process_group holds {ours}: gradients "
                    "must be reduced over the ranks that share the parameters; pass a group over the same ranks "
                    "or ProcessGroupName.reduce_scatter"
                )
        return dataclasses.replace(policies, reduce=dataclasses.replace(policies.reduce, group=choice))


def _choice_name(choice: Any) -> str:
    return f"ProcessGroupName.{choice.name}" if isinstance(choice, ProcessGroupName) else type(choice).__name__


def plan_reduce_channels(
    units: list[tuple[str, FullyShardedDataParallel]],
) -> Callable[[], dict[int, GroupLike]]:
    """Check that units sharing a parameter group agree on where it reduce-scatters; return what creates the
    channels (keyed by ``id`` of the parameter group), to be called on every rank at the same point."""
    chosen: dict[int, tuple[GroupLike, Any, str]] = {}
    for path, unit in units:
        group, choice = unit._unit.group.group, unit._policies.reduce.group
        name = path or f"<root {type(unit.module).__name__}>"
        earlier = chosen.setdefault(id(group), (group, choice, name))
        if earlier[1] is not choice:
            raise ValueError(
                f"units '{earlier[2]}' and '{name}' shard over the same process group but ask for different "
                f"process_group_reduce_scatter ({_choice_name(earlier[1])} and {_choice_name(choice)}); "
                "give every unit of one process group the same value"
            )

    def create() -> dict[int, GroupLike]:
        separate = [g for g, choice, _ in chosen.values() if choice is ProcessGroupName.reduce_scatter]
        channels = create_reduce_channels(separate)
        for key, (_, choice, _) in chosen.items():
            if not isinstance(choice, ProcessGroupName):
                channels[key] = choice
        return channels

    return create


def make_fp16_to_fp32_caster() -> Callable[[Any], Any]:
    """``force_input_to_fp32``: cast float16 tensors in a nested structure to float32 (differentiably)."""

    def cast(tensor: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float16:
            return tensor.float()
        return tensor

    return lambda tree: tree_map(cast, tree)
