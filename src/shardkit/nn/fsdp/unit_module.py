"""The module face of one wrapped unit: what a :class:`~shardkit.nn.fsdp.FullyShardedDataParallel` instance *is*
and reports, for the layers that build on it without depending on the public class.

:class:`UnitModule` is the type the read model (:mod:`shardkit.nn.fsdp.shard_layout`, which the state dicts and
the checkpoint adapters read) walks: its run-time state through one accessor (:attr:`UnitModule.fsdp_unit`, the
:class:`~shardkit.nn.fsdp.runtime.Unit` with its parameter group), the settings under fairscale's attribute names,
and names as the unwrapped model spells them (:func:`walk_modules`, the one walker that knows which wrapper levels
add no path segment). What a unit *does* (forward, summon, state dicts, optimizer state) lives in modules
that take a :class:`UnitModule` (:mod:`~shardkit.nn.fsdp.forward_methods`, :mod:`~shardkit.nn.fsdp.full_params`,
:mod:`~shardkit.nn.fsdp.state_dict`) and that the public class, its only subclass, delegates to; this module
imports none of them, so the layers form no cycle. torch's FSDP2 splits its ``FSDPModule`` the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable, Generic, Optional, TypeVar, Union, overload

import torch
from torch import nn

from shardkit.distributed.groups import GroupLike
from shardkit.nn.checkpoint.wrapper import adds_no_name
from shardkit.nn.fsdp.flat_param import FlatParamMeta
from shardkit.nn.fsdp.module_view import FlatModuleView
from shardkit.nn.fsdp.policies import CPUOffload, FSDPPolicies, ProcessGroupName
from shardkit.nn.fsdp.runtime import TrainingState, Unit


def walk_modules(
    root: nn.Module, prefix: str = "", *, once: bool = True, into_units: bool = True
) -> Iterator[tuple[str, str, nn.Module]]:
    """Pre-order ``(clean path, real path, module)`` from ``root`` (itself first, at ``prefix``).

    The clean path is the unwrapped model's: the child ``module`` of a :class:`UnitModule` and the module inside a
    :class:`~shardkit.nn.checkpoint.CheckpointWrapper` add no segment. ``once``: a module reached along several
    paths appears once (as ``named_modules`` does); otherwise once per path (as ``nn.Module.state_dict`` does).
    ``into_units=False``: a nested unit is yielded but not entered.
    """
    seen: set[int] = set()

    def visit(module: nn.Module, clean: str, real: str) -> Iterator[tuple[str, str, nn.Module]]:
        if once:
            if id(module) in seen:
                return
            seen.add(id(module))
        yield clean, real, module
        if not into_units and module is not root and isinstance(module, UnitModule):
            return
        for name, child in module._modules.items():
            if child is None:
                continue
            transparent = (isinstance(module, UnitModule) and name == "module") or adds_no_name(module, name)
            yield from visit(child, clean if transparent else join_name(clean, name), join_name(real, name))

    yield from visit(root, prefix, prefix)


def join_name(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` alone at the root."""
    return f"{prefix}.{name}" if prefix else name


def _clean_members(root: nn.Module, kind: str, prefix: str, remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for ``kind`` = ``"_parameters"`` or ``"_buffers"`` under clean names."""
    seen: set[int] = set()
    for path, _, module in walk_modules(root, prefix):
        for name, value in getattr(module, kind).items():
            if value is None or (remove_duplicate and id(value) in seen):
                continue
            seen.add(id(value))
            yield join_name(path, name), value


_T = TypeVar("_T")


class PolicySetting(Generic[_T]):
    """A read-only attribute of :class:`UnitModule` read from the unit's policies: one line per fairscale name.

    Example (in the class body)::

        flatten_parameters = PolicySetting(lambda p: p.sharding.flatten_parameters)
    """

    def __init__(self, read: Callable[[FSDPPolicies], _T], doc: Optional[str] = None) -> None:
        self.read = read
        self.name = ""
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        if self.__doc__ is None:
            self.__doc__ = f"fairscale's ``{name}`` setting of this unit (read-only; from its policies)."

    @overload
    def __get__(self, unit: None, owner: type) -> PolicySetting[_T]: ...
    @overload
    def __get__(self, unit: UnitModule, owner: type) -> _T: ...
    def __get__(self, unit: Optional[UnitModule], owner: type) -> Union[_T, PolicySetting[_T]]:
        if unit is None:
            return self
        return self.read(unit.fsdp_unit.policies)

    def __set__(self, unit: UnitModule, value: Any) -> None:
        raise AttributeError(
            f"{self.name} is fixed when the unit is built; pass {self.name}= to FullyShardedDataParallel instead"
        )


class UnitModule(nn.Module):
    """Base of :class:`~shardkit.nn.fsdp.FullyShardedDataParallel` (its one base): a wrapped unit's state and settings.

    Not constructed on its own; the subclass's constructor sets the attributes declared here.
    """

    #: The group this unit is sharded over, this rank's index in it and its size.
    process_group: GroupLike
    rank: int
    world_size: int
    #: Original dtypes of floating-point buffers cast for mixed precision (clean name -> dtype), root only.
    buffer_original_dtypes: dict[str, torch.dtype]
    _unit: Unit

    # ------------------------------------------------------------------ the wrapped module
    @property
    def wrapped_module(self) -> nn.Module:
        """The user's module this unit wraps (the child registered as ``module``)."""
        wrapped = self._modules.get("module")
        if wrapped is None:  # during construction (hasattr must see no attribute yet)
            raise AttributeError("the wrapped module is not set yet")
        return wrapped

    @property
    def module(self) -> nn.Module:
        """The wrapped module, at fairscale's level: with ``flatten_parameters`` (the default) a view whose
        ``.module`` is the user's module and whose other attributes are the user's module's (fairscale puts its
        flattening wrapper there); otherwise the user's module itself. See :mod:`shardkit.nn.fsdp.module_view`."""
        wrapped = self.wrapped_module
        if "_unit" not in self.__dict__ or not self.flatten_parameters:
            return wrapped
        view: Any = FlatModuleView(wrapped)  # answers as the user's module (see module_view)
        return view

    @property
    def _fsdp_wrapped_module(self) -> nn.Module:
        """fairscale's private name for :attr:`module` (read by VISSL's hooks)."""
        return self.module

    # ------------------------------------------------------------------ run-time state
    @property
    def fsdp_unit(self) -> Unit:
        """This unit's run-time state: its :class:`~shardkit.nn.fsdp.param_group.ParamGroup` (``.group``, whose
        ``handles`` are the flat parameters), its :class:`TrainingState`, its name and, on the root, the tree's
        units and schedule. For the core's layers; readers of the shards use :func:`shardkit.nn.fsdp.layout`."""
        return self._unit

    def fsdp_units(self, recurse: bool = True) -> list[Unit]:
        """This unit's run-time state and, with ``recurse``, that of every unit below it (``modules()`` order)."""
        return [m.fsdp_unit for m in self.modules() if isinstance(m, UnitModule)] if recurse else [self._unit]

    @property
    def _policies(self) -> FSDPPolicies:
        return self._unit.policies

    @property
    def training_state(self) -> TrainingState:
        return self._unit.state

    @property
    def is_root(self) -> Optional[bool]:
        """True for the outermost instance once a forward has run (None before)."""
        return self._unit.is_root

    @property
    def _is_root(self) -> Optional[bool]:
        """fairscale's private spelling of :attr:`is_root`; setting it to None forgets the tree (as fairscale's
        code and VISSL's do before wrapping units into a new root), like :meth:`_reset_lazy_init`."""
        return self._unit.is_root

    @_is_root.setter
    def _is_root(self, value: Optional[bool]) -> None:
        if value is not None:
            raise ValueError(
                f"_is_root can only be set to None (forget the root decided at the first forward), got {value!r}; "
                "the outermost unit becomes the root at its next forward"
            )
        self._unit.leave_tree()

    def _reset_lazy_init(self) -> None:
        """Forget which unit is the root (fairscale's name): the next forward of the outermost unit decides
        again. Call it on every unit whose tree changed (VISSL resets each one), between steps."""
        self._unit.leave_tree()

    @property
    def flat_params(self) -> list[nn.Parameter]:
        """This unit's shards, in order (each registered on this instance as ``flat_param_<i>``)."""
        return [h.shard for h in self._unit.group.handles]

    @property
    def flat_param_names(self) -> list[str]:
        """Attribute names of :attr:`flat_params` on this instance."""
        return [h.name for h in self._unit.group.handles]

    @property
    def flat_param_metas(self) -> list[FlatParamMeta]:
        """Layout of each flat parameter: original names (relative to ``.module``), shapes, offsets, padding
        and this rank's shard range. See :mod:`shardkit.nn.fsdp.flat_param`."""
        return [h.meta for h in self._unit.group.handles]

    def unsharded_bytes(self) -> int:
        """Bytes this unit currently holds in full (gathered) parameter copies; 0 when fully resharded."""
        return self._unit.group.unsharded_bytes()

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
        return [p for p in self.parameters() if p.grad is not None]

    def append_shared_param(self, p: nn.Parameter) -> None:
        """Not supported: fairscale's experimental way to share one parameter between two units."""
        raise NotImplementedError(
            "append_shared_param is not supported: shardkit stores a tied parameter once, in the unit that holds "
            "every module using it; wrap the modules sharing the parameter in one FullyShardedDataParallel unit"
        )

    # ------------------------------------------------------------------ settings, as fairscale names them
    # fairscale's (and torch FSDP's) read-only attributes, one line each, read from the unit's policies.
    mixed_precision = PolicySetting(lambda p: p.mixed_precision.enabled)
    compute_dtype = PolicySetting(lambda p: p.mixed_precision.param_dtype)
    buffer_dtype = PolicySetting(lambda p: p.mixed_precision.buffer_dtype)
    fp32_reduce_scatter = PolicySetting(lambda p: p.mixed_precision.reduce_dtype == torch.float32)
    clear_autocast_cache = PolicySetting(lambda p: p.mixed_precision.clear_autocast_cache)
    force_input_to_fp32 = PolicySetting(lambda p: p.mixed_precision.force_input_to_fp32)
    flatten_parameters = PolicySetting(lambda p: p.sharding.flatten_parameters)
    reshard_after_forward = PolicySetting(lambda p: p.sharding.reshard_after_forward)
    disable_reshard_on_root = PolicySetting(lambda p: p.sharding.disable_reshard_on_root)
    sharding_strategy = PolicySetting(lambda p: p.sharding.strategy, "torch FSDP's :class:`ShardingStrategy`.")
    move_params_to_cpu = PolicySetting(lambda p: p.offload.offload_params)
    move_grads_to_cpu = PolicySetting(
        lambda p: p.offload.offload_params, "Gradient shards live where the parameter shards do (CPU under offload)."
    )
    cpu_offload = PolicySetting(lambda p: CPUOffload(offload_params=p.offload.offload_params))
    backward_prefetch = PolicySetting(lambda p: p.prefetch.backward)
    forward_prefetch = PolicySetting(lambda p: p.prefetch.forward)
    state_dict_device = PolicySetting(lambda p: p.state_dict.device)
    state_dict_on_rank_0_only = PolicySetting(lambda p: p.state_dict.rank0_only)
    bucket_cap_mb = PolicySetting(lambda p: p.bucket_cap_mb)
    verbose = PolicySetting(lambda p: p.verbose)
    allow_reset_parameters = PolicySetting(lambda p: p.allow_reset_parameters)
    replica_group = PolicySetting(
        lambda p: p.reduce.replica_group,
        "The ranks holding the same shards as this one (hybrid sharding: the same local rank on every node; "
        "NO_SHARD: every rank), over which reduced gradient shards are all-reduced; None without replicas. "
        "``process_group`` is the shard group, so a checkpoint counts ``world // world_size`` replicas.",
    )

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
    def gradient_predivide_factor(self) -> float:
        """What gradients are divided by before the reduction (see :meth:`set_gradient_divide_factors`)."""
        return self._unit.divide_factors()[0]

    @property
    def gradient_postdivide_factor(self) -> float:
        """What the reduced gradient shards are divided by."""
        return self._unit.divide_factors()[1]

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """Divide gradients by ``pre`` before the reduction and by ``post`` after it (fairscale's API).

        ``pre * post == world_size`` keeps the average; any other pair scales every gradient by
        ``world_size / (pre * post)``. With ``recursive`` every nested unit gets the same factors. Only between
        steps.
        """
        if not (pre > 0 and post > 0):
            raise ValueError(f"set_gradient_divide_factors: factors must be > 0, got pre={pre}, post={post}")
        targets = self.fsdp_units(recursive)
        for unit in targets:
            unit.assert_state(TrainingState.IDLE)
        for unit in targets:
            unit.set_divide_factors(float(pre), float(post))

    # ------------------------------------------------------------------ names
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters named as in the unwrapped model: wrapper levels do not add a ``module.`` segment.

        Outside ``summon_full_params`` these are the shards (``<unit path>.flat_param_<i>``); inside it, the
        original parameters with their original names.
        """
        if not recurse:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        yield from _clean_members(self, "_parameters", prefix, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Buffers named as in the unwrapped model (see :meth:`named_parameters`)."""
        if not recurse:
            yield from super().named_buffers(prefix, recurse, remove_duplicate)
            return
        yield from _clean_members(self, "_buffers", prefix, remove_duplicate)

    def __getitem__(self, key: int) -> Any:
        """Index the wrapped module (when it is a container such as ``nn.Sequential``)."""
        container: Any = self.wrapped_module
        return container[key]

    # ------------------------------------------------------------------ repr
    def extra_repr(self) -> str:
        verbose = self._policies.verbose
        names = [n for n, v in vars(UnitModule).items() if isinstance(v, PolicySetting)] if verbose else _SHORT_REPR
        text = f"world_size={self.world_size}, " + ", ".join(f"{name}={getattr(self, name)}" for name in names)
        if not verbose:
            return text
        return text + (
            f", rank={self.rank}, is_root={self._unit.is_root}, compute_device={self.compute_device}, "
            f"process_group_reduce_scatter={choice_name(self._policies.reduce.group)}, "
            f"gradient_divide_factors={self._unit.divide_factors()}"
        )


#: The settings a unit's ``repr`` shows without ``verbose`` (with it: every :class:`PolicySetting`).
_SHORT_REPR = ("flatten_parameters", "reshard_after_forward", "mixed_precision")


def choice_name(choice: Any) -> str:
    """How a ``process_group_reduce_scatter`` choice reads in messages and the verbose repr."""
    return f"ProcessGroupName.{choice.name}" if isinstance(choice, ProcessGroupName) else type(choice).__name__
