"""The settings of :class:`~shardkit.lightning.DDPFullyShardedStrategy`, validated once at construction.

The strategy's constructor keeps the argument names users know from Lightning and fairscale
(``cpu_offload``, ``activation_checkpointing``, ``auto_wrap_policy``, ``min_num_params`` ...) and turns them into
one frozen :class:`FullyShardedConfig`; nothing else in the strategy reads the loose arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union, cast

from torch import nn

from shardkit.nn.checkpoint import module_matcher
from shardkit.nn.fsdp import CPUOffload
from shardkit.nn.wrap import default_auto_wrap_policy, transformer_auto_wrap_policy

ModuleClasses = Union[type[nn.Module], Iterable[type[nn.Module]]]
StateDictType = Literal["full", "sharded"]

#: FSDP arguments the strategy sets itself (from the Trainer's device and precision).
_STRATEGY_OWNED = ("module", "compute_device")


@dataclass(frozen=True)
class FullyShardedConfig:
    """What the fully sharded strategy does to the LightningModule (checked in ``__post_init__``)."""

    #: ``(name, value)`` arguments for every :class:`~shardkit.nn.FullyShardedDataParallel` unit the strategy
    #: builds (a tuple, so the config stays immutable and picklable for spawned workers); precision settings are
    #: added at setup from the Trainer's precision.
    fsdp_arguments: tuple[tuple[str, Any], ...] = ()
    #: ``policy(module, recurse, nonwrapped_numel) -> bool`` that cuts the model into units, or None to wrap only
    #: the root (plus what ``configure_model`` wrapped by hand).
    auto_wrap_policy: Optional[Callable[..., bool]] = None
    #: Predicate choosing the modules whose activations are recomputed, or None.
    checkpoint_on: Optional[Callable[[nn.Module], bool]] = None
    #: Keep the checkpointed modules' saved inputs in host memory.
    checkpoint_offload: bool = False
    #: ``"full"`` checkpoints (one file, any world size) or ``"sharded"`` (a folder written by
    #: ``torch.distributed.checkpoint``, one shard per rank, same world size to resume).
    state_dict_type: StateDictType = "full"

    def __post_init__(self) -> None:
        names = [entry[0] if isinstance(entry, tuple) and len(entry) == 2 else None for entry in self.fsdp_arguments]
        if not isinstance(self.fsdp_arguments, tuple) or not all(isinstance(n, str) for n in names):
            raise TypeError("FullyShardedConfig.fsdp_arguments must be a tuple of (name, value) pairs")
        owned = [k for k in _STRATEGY_OWNED if k in names]
        if owned:
            raise ValueError(f"{owned} are set by the strategy from the Trainer's devices; do not pass them")
        if self.state_dict_type not in ("full", "sharded"):
            raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {self.state_dict_type!r}")
        for name, value in (("auto_wrap_policy", self.auto_wrap_policy), ("checkpoint_on", self.checkpoint_on)):
            if value is not None and not callable(value):
                raise TypeError(f"FullyShardedConfig.{name} must be callable or None, got {value!r}")
        if not isinstance(self.checkpoint_offload, bool):
            raise TypeError(f"activation_checkpointing_offload must be True or False, got {self.checkpoint_offload!r}")

    @property
    def fsdp_kwargs(self) -> dict[str, Any]:
        """A fresh dict of :attr:`fsdp_arguments`."""
        return dict(self.fsdp_arguments)


def build_config(
    *,
    cpu_offload: Any,
    activation_checkpointing: Optional[ModuleClasses],
    activation_checkpointing_offload: bool,
    auto_wrap_policy: Any,
    min_num_params: Optional[float],
    transformer_layer_cls: Optional[ModuleClasses],
    state_dict_type: str,
    fsdp_kwargs: Mapping[str, Any],
) -> FullyShardedConfig:
    """Translate the strategy's arguments (the config checks them); raises ValueError/TypeError saying what to do."""
    kwargs = dict(fsdp_kwargs)
    offload = _offload_kwargs(cpu_offload)
    kwargs.update(offload)
    return FullyShardedConfig(
        fsdp_arguments=tuple(kwargs.items()),
        auto_wrap_policy=_wrap_policy(auto_wrap_policy, min_num_params, transformer_layer_cls),
        checkpoint_on=None if activation_checkpointing is None else module_matcher(activation_checkpointing),
        checkpoint_offload=bool(activation_checkpointing_offload),
        state_dict_type=cast(StateDictType, state_dict_type),
    )


def _offload_kwargs(cpu_offload: Any) -> dict[str, Any]:
    if cpu_offload is None or cpu_offload is False:
        return {}
    if cpu_offload is True:
        return {"cpu_offload": CPUOffload(offload_params=True)}
    if isinstance(cpu_offload, CPUOffload):
        return {"cpu_offload": cpu_offload}
    raise TypeError(f"cpu_offload must be a bool or shardkit.nn.fsdp.CPUOffload, got {cpu_offload!r}")


def _wrap_policy(
    auto_wrap_policy: Any, min_num_params: Optional[float], transformer_layer_cls: Optional[ModuleClasses]
) -> Optional[Callable[..., bool]]:
    """One auto-wrap policy from the three ways of asking for one (at most one may be used)."""

    given = [
        name
        for name, value in (
            ("auto_wrap_policy", auto_wrap_policy),
            ("min_num_params", min_num_params),
            ("transformer_layer_cls", transformer_layer_cls),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(f"pass only one of {given}: each of them chooses the auto-wrap policy")
    if min_num_params is not None:
        if min_num_params <= 0:
            raise ValueError(f"min_num_params must be positive, got {min_num_params}")
        return functools.partial(default_auto_wrap_policy, min_num_params=min_num_params)
    classes = transformer_layer_cls
    if auto_wrap_policy is not None:
        if isinstance(auto_wrap_policy, (type, set, frozenset, list, tuple)):
            classes = auto_wrap_policy  # Lightning's convenience: a set of block classes
        elif callable(auto_wrap_policy):
            return auto_wrap_policy
        else:
            raise TypeError(
                f"auto_wrap_policy must be a policy(module, recurse, nonwrapped_numel) or block classes, got "
                f"{auto_wrap_policy!r}"
            )
    if classes is None:
        return None
    block_classes = (classes,) if isinstance(classes, type) else tuple(classes)
    module_matcher(block_classes)  # validates: non-empty, nn.Module subclasses
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=block_classes)
