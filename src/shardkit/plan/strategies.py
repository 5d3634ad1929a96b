"""The strategies ``shardkit.plan`` runs, each built from the user's model exactly as a training script would.

A builder takes the unwrapped model, the optimizer class and its options, and the strategy's options (the
constructor's keyword arguments), and returns ``(model, optimizer, after_step)``: the loop is then
``loss_fn(model(*batch), batch).backward(); optimizer.step(); after_step(); optimizer.zero_grad()``.
Options are checked against the constructor's signature before anything is built, so a misspelt option is a
clear error naming the valid ones. The accuracy tests run these same builders on real gloo processes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

Built = tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]
#: ``(model, optimizer class, optimizer options, strategy options, topology or None) -> Built``.
Builder = Callable[[nn.Module, type, Mapping[str, Any], Mapping[str, Any], Optional[Any]], Built]


class OptionError(ValueError):
    """A strategy option that the strategy does not take, or an unknown strategy."""


#: FSDP options that move state to host memory (planned on the meta device only: :mod:`shardkit.plan.host`).
_OFFLOAD_OPTIONS = ("cpu_offload", "move_params_to_cpu", "move_grads_to_cpu")


def offload_options(strategy: str, options: Mapping[str, Any]) -> list[str]:
    """The options in ``options`` that offload ``strategy``'s state to host memory (empty for none)."""
    if strategy != "fsdp":
        return []
    return sorted(name for name in _OFFLOAD_OPTIONS if options.get(name))


def _nothing() -> None:
    return None


def _check_options(strategy: str, target: Any, options: Mapping[str, Any], extra: tuple[str, ...] = ()) -> None:
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = {name for name, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL} | set(extra)
    known -= {"self", "module", "params", "sharded_optimizer", "process_group", "group"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise OptionError(
            f"strategy {strategy!r} has no option {', '.join(map(repr, unknown))}; its options are "
            f"{', '.join(sorted(known))}"
        )


def _split(options: Mapping[str, Any], key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Options for the wrapper, and the nested ``options[key]`` dict (OSS's own options)."""
    rest = dict(options)
    nested = rest.pop(key, None) or {}
    if not isinstance(nested, Mapping):
        raise OptionError(f"strategy option {key!r} must be a dict of keyword arguments, got {type(nested).__name__}")
    return rest, dict(nested)


def _hybrid_group(strategy: str, options: dict[str, Any], topology: Optional[Any]) -> Optional[Any]:
    """The node topology when the planner option ``hybrid=True`` asks to shard inside nodes, else None."""
    if not options.pop("hybrid", False):
        return None
    if topology is None:
        raise OptionError(f"strategy {strategy!r} with hybrid=True needs nprocs_per_node (the ranks of one node)")
    return topology


def _build_ddp(
    model: nn.Module,
    optim: type,
    optim_opts: Mapping[str, Any],
    opts: Mapping[str, Any],
    topology: Optional[Any] = None,
) -> Built:
    from torch.nn.parallel import DistributedDataParallel

    _check_options("ddp", DistributedDataParallel.__init__, opts)
    wrapped = DistributedDataParallel(model, **opts)
    return wrapped, optim(wrapped.parameters(), **optim_opts), _nothing


def _oss_options(
    name: str, wrapper_init: Any, opts: Mapping[str, Any], topology: Optional[Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The wrapper's options and OSS's (``opts["oss"]``), both checked; OSS shards inside the node when hybrid."""
    # start-up cost: the planner imports a strategy's package (and torch._dynamo) only when it builds it
    from shardkit.optim import OSS

    wrapper_opts, oss_opts = _split(opts, "oss")
    nodes = _hybrid_group(name, wrapper_opts, topology)
    _check_options(name, wrapper_init, wrapper_opts, ("oss",))
    _check_options(f"{name} (oss=...)", OSS.__init__, oss_opts)
    if nodes is not None:
        oss_opts["group"] = nodes
    return wrapper_opts, oss_opts


def _build_oss_ddp(
    model: nn.Module,
    optim: type,
    optim_opts: Mapping[str, Any],
    opts: Mapping[str, Any],
    topology: Optional[Any] = None,
) -> Built:
    from torch.nn.parallel import DistributedDataParallel

    # start-up cost: the planner imports a strategy's package (and torch._dynamo) only when it builds it
    from shardkit.optim import OSS

    ddp_opts, oss_opts = _oss_options("oss_ddp", DistributedDataParallel.__init__, opts, topology)
    wrapped = DistributedDataParallel(model, **ddp_opts)
    return wrapped, OSS(wrapped.parameters(), optim=optim, **oss_opts, **optim_opts), _nothing


def _build_oss_sdp(
    model: nn.Module,
    optim: type,
    optim_opts: Mapping[str, Any],
    opts: Mapping[str, Any],
    topology: Optional[Any] = None,
) -> Built:
    # start-up cost: the planner imports a strategy's package (and torch._dynamo) only when it builds it
    from shardkit.nn import ShardedDataParallel
    from shardkit.optim import OSS

    sdp_opts, oss_opts = _oss_options("oss_sdp", ShardedDataParallel.__init__, opts, topology)
    sharded = OSS(model.parameters(), optim=optim, **oss_opts, **optim_opts)
    return ShardedDataParallel(model, sharded, **sdp_opts), sharded, _nothing


def block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of the modules held in ``model``'s ``nn.ModuleList``s: a transformer's blocks."""
    return {type(child) for module in model.modules() if isinstance(module, nn.ModuleList) for child in module}


def _build_fsdp(
    model: nn.Module,
    optim: type,
    optim_opts: Mapping[str, Any],
    opts: Mapping[str, Any],
    topology: Optional[Any] = None,
) -> Built:
    # start-up cost: the planner imports a strategy's package (and torch._dynamo) only when it builds it
    from shardkit.nn import FullyShardedDataParallel
    from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy

    fsdp_opts = dict(opts)
    policy = fsdp_opts.pop("auto_wrap_policy", "blocks")
    _check_options("fsdp", FullyShardedDataParallel.__init__, fsdp_opts, ("auto_wrap_policy",))
    if isinstance(fsdp_opts.get("sharding_strategy"), str):  # a name, as JSON and the command line give it
        # start-up cost: the planner imports a strategy's package (and torch._dynamo) only when it builds it
        from shardkit.nn import ShardingStrategy

        try:
            fsdp_opts["sharding_strategy"] = ShardingStrategy[fsdp_opts["sharding_strategy"]]
        except KeyError:
            names = ", ".join(s.name for s in ShardingStrategy)
            raise OptionError(f"fsdp sharding_strategy must be one of {names}") from None
    if "HYBRID" in str(fsdp_opts.get("sharding_strategy", "")).upper() and "process_group" not in fsdp_opts:
        if topology is None:
            raise OptionError("fsdp with a hybrid sharding_strategy needs nprocs_per_node (the ranks of one node)")
        fsdp_opts["process_group"] = topology
    if policy == "blocks":  # the default: one unit per block of every ModuleList (a transformer's layers)
        classes = block_classes(model)
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes) if classes else None
    if policy is not None:
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **fsdp_opts):
            model = auto_wrap(model, auto_wrap_policy=policy)
    wrapped = FullyShardedDataParallel(model, **fsdp_opts)
    return wrapped, optim(wrapped.parameters(), **optim_opts), _nothing


def _build_slowmo(
    model: nn.Module,
    optim: type,
    optim_opts: Mapping[str, Any],
    opts: Mapping[str, Any],
    topology: Optional[Any] = None,
) -> Built:
    # start-up cost: the planner imports a strategy's package (and torch._dynamo) only when it builds it
    from shardkit.nn.slowmo import SlowMoDistributedDataParallel

    per_node = topology.nprocs_per_node if topology is not None else 1
    slowmo_opts = {"nprocs_per_node": per_node, **opts}
    _check_options("slowmo", SlowMoDistributedDataParallel.__init__, slowmo_opts)
    wrapped = SlowMoDistributedDataParallel(model, **slowmo_opts)
    optimizer = optim(wrapped.parameters(), **optim_opts)
    return wrapped, optimizer, functools.partial(wrapped.perform_slowmo, optimizer)


@dataclass(frozen=True)
class PlanStrategy:
    """One strategy the planner knows: its name, what it is, and its builder."""

    name: str
    description: str
    build: Builder


STRATEGIES: dict[str, PlanStrategy] = {
    s.name: s
    for s in (
        PlanStrategy("ddp", "torch DDP (every rank holds everything)", _build_ddp),
        PlanStrategy("oss_ddp", "torch DDP + shardkit OSS (ZeRO-1: optimizer state sharded)", _build_oss_ddp),
        PlanStrategy("oss_sdp", "shardkit OSS + ShardedDataParallel (ZeRO-2: + gradients sharded)", _build_oss_sdp),
        PlanStrategy("fsdp", "shardkit FullyShardedDataParallel (ZeRO-3: + parameters sharded)", _build_fsdp),
        PlanStrategy("slowmo", "shardkit SlowMo DDP (local SGD between nodes + slow momentum)", _build_slowmo),
    )
}

#: Strategies planned by a path of their own (pipeline parallelism), not by a builder here.
PIPELINE = "smp"


def get(name: str) -> PlanStrategy:
    """The strategy called ``name``, or a clear error listing the known ones."""
    try:
        return STRATEGIES[name]
    except KeyError:
        known = ", ".join([*STRATEGIES, PIPELINE])
        raise OptionError(f"unknown strategy {name!r}; shardkit.plan knows: {known}") from None


__all__ = ["PIPELINE", "STRATEGIES", "OptionError", "PlanStrategy", "block_classes", "get", "offload_options"]
