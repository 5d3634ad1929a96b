"""The one strategy registry: each data-parallel strategy by name, and how to build its model and optimizer.

``shardkit bench``, ``shardkit demo``, ``shardkit plan`` and the tests all build strategies through it. An entry
names a builder (:mod:`.builders`) that, given a freshly built model, an :class:`OptimizerSpec`, a process group
(``None``: the default group), the strategy's options and the node topology, returns ``(model, optimizer,
after_step)`` ready for the loop ``loss_fn(model(x), y).backward(); optimizer.step(); after_step();
optimizer.zero_grad()``. Options are the wrapper constructor's keyword arguments, checked against its signature
(:class:`OptionError` names the valid ones).

Strategies whose implementation has not landed yet (their import fails) are listed as not available instead
of failing; the tools pick them up as soon as their modules exist.

Adding a strategy is one :func:`register` call next to the others::

    def build_mine(model, optim, group, options, topology):
        check_options("mine", MyWrapper.__init__, options)
        model = MyWrapper(model, process_group=group, **options)
        return model, optim.make(optim.params(model)), nothing

    register(Strategy("mine", "my wrapper", build_mine, requires=("my.package",)))
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from shardkit.distributed import comm_formulas as comm
from shardkit.strategies import builders
from shardkit.strategies.options import Built, OptimizerSpec, OptionError

Group = Any  # a torch.distributed ProcessGroup (kept loose: the builders pass it straight through)


#: ``(model, optimizer spec, group or None, options, topology or None) -> (model, optimizer, after_step)``.
Builder = Callable[[nn.Module, OptimizerSpec, Group, dict[str, Any], Any], Built]


@dataclass(frozen=True)
class Strategy:
    """One way of training data-parallel: a name, what it is, and its builder.

    ``requires`` names modules (``"pkg.mod"`` or ``"pkg.mod:attr"``) whose import must succeed for the strategy
    to be available. ``torch_comm`` estimates the bytes per step (per rank, on the wire, ring algorithms) of
    collectives that torch issues internally, which :func:`~shardkit.distributed.count_comm_bytes` cannot
    see; ``None`` means every collective of the strategy goes through shardkit's counted collectives.
    ``defaults`` are the options :meth:`build` uses when the caller gives none (how bench and the demo run it);
    a variant such as ``fsdp_no_reshard`` is its base builder with other defaults. ``side_by_side=False`` keeps
    a strategy out of :func:`all_strategies`, the set bench, the demo and the GPU check run by default (SlowMo:
    its local SGD follows its own trajectory, so a loss table beside DDP's would show a mismatch by design).
    """

    name: str
    description: str
    builder: Builder
    requires: tuple[str, ...] = ()
    torch_comm: Optional[Callable[[nn.Module, int], int]] = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    side_by_side: bool = True

    def build(
        self,
        model: nn.Module,
        optim: Optional[OptimizerSpec] = None,
        group: Group = None,
        options: Optional[Mapping[str, Any]] = None,
        topology: Any = None,
    ) -> Built:
        """Wrap ``model`` and build its optimizer (every rank must call it: wrappers synchronise when built).

        ``optim`` defaults to AdamW with torch's settings. ``options`` replace :attr:`defaults` when given (an
        empty mapping: the constructors' own defaults), so the planner's ``{}`` means exactly what
        ``FullyShardedDataParallel(model)`` means.

        Example::

            sgd = OptimizerSpec(torch.optim.SGD, {"lr": 0.1})
            model, optimizer, after_step = get_strategy("oss_sdp").build(net, sgd)
        """
        chosen = dict(self.defaults) if options is None else dict(options)
        return self.builder(model, optim if optim is not None else OptimizerSpec(), group, chosen, topology)

    def variant(self, name: str, description: str, **defaults: Any) -> Strategy:
        """This strategy's builder under another name, with ``defaults`` (not registered: for a suite's own rows)."""
        return dataclasses.replace(self, name=name, description=description, defaults=defaults)

    def unavailable_reason(self) -> Optional[str]:
        """``None`` when the strategy can run here, else why not (the first requirement that fails)."""
        for requirement in self.requires:
            reason = _requirement_problem(requirement)
            if reason is not None:
                return reason
        return None


def _requirement_problem(requirement: str) -> Optional[str]:
    """Why ``"package.module"`` or ``"package.module:attribute"`` cannot be imported, or ``None`` if it can."""
    module, _, attribute = requirement.partition(":")
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            return f"{module} does not exist yet"
        return f"{module} fails to import ({type(exc).__name__}: {exc})"
    except Exception as exc:  # a half-landed module may fail with any error: report it, never crash
        return f"{module} fails to import ({type(exc).__name__}: {exc})"
    if attribute and not hasattr(imported, attribute):
        where = f" in torch {torch.__version__}" if module.startswith("torch.") else " yet"
        return f"{module} does not define {attribute}{where}"
    return None


_REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` to the registry (names are unique)."""
    if strategy.name in _REGISTRY:
        raise ValueError(f"a strategy named {strategy.name!r} is already registered")
    _REGISTRY[strategy.name] = strategy
    return strategy


def all_strategies() -> list[Strategy]:
    """Every side-by-side strategy, available or not, in registration order (DDP, the baseline, first).

    This is what bench, the demo and the GPU check run by default; :func:`registered_names` also lists the
    strategies that only run when named (SlowMo).
    """
    return [strategy for strategy in _REGISTRY.values() if strategy.side_by_side]


def registered_names() -> list[str]:
    """The name of every registered strategy, side by side or not, in registration order."""
    return list(_REGISTRY)


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; an unknown name raises an error listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known strategies: {', '.join(_REGISTRY)}") from None


def select(names: Optional[Iterable[str]] = None) -> tuple[list[Strategy], dict[str, str]]:
    """Available strategies among ``names`` (:func:`all_strategies` by default), and ``{name: reason}`` for the rest."""
    chosen = [get_strategy(n) for n in names] if names is not None else all_strategies()
    available: list[Strategy] = []
    missing: dict[str, str] = {}
    for strategy in chosen:
        reason = strategy.unavailable_reason()
        if reason is None:
            available.append(strategy)
        else:
            missing[strategy.name] = reason
    return available, missing


# --- the entries ----------------------------------------------------------------------------------------------
#: Prefetch one block ahead in both directions (torch FSDP2 prefetches in backward by default): how the
#: side-by-side tools run shardkit FSDP. Names, not the enum, so listing strategies never imports FSDP.
_PREFETCH = {"backward_prefetch": "BACKWARD_PRE", "forward_prefetch": True}
_FSDP = ("shardkit.nn.fsdp:FullyShardedDataParallel",)

register(
    Strategy(
        "ddp",
        "torch DDP (every rank holds everything; the baseline)",
        builders.build_ddp,
        torch_comm=comm.ddp_allreduce_bytes,
    )
)
register(
    Strategy(
        "zero_torch",
        "torch DDP + torch ZeroRedundancyOptimizer",
        builders.build_zero_torch,
        torch_comm=comm.ddp_plus_param_broadcast_bytes,
    )
)
register(
    Strategy(
        "oss_ddp",
        "torch DDP + shardkit OSS (ZeRO-1: optimizer state sharded)",
        builders.build_oss_ddp,
        requires=("shardkit.optim.zero1:OSS",),
        torch_comm=comm.ddp_allreduce_bytes,
    )
)
register(
    Strategy(
        "oss_sdp",
        "shardkit OSS + ShardedDataParallel (ZeRO-2: + gradients sharded)",
        builders.build_oss_sdp,
        requires=("shardkit.optim.zero1:OSS", "shardkit.nn.sharded_ddp:ShardedDataParallel"),
    )
)
register(
    Strategy(
        "fsdp",
        "shardkit FullyShardedDataParallel per block + root (ZeRO-3: + parameters sharded); by default reshard "
        "after forward, prefetch one block ahead",
        builders.build_fsdp,
        requires=_FSDP,
        defaults=_PREFETCH,
    )
)
register(
    Strategy(
        "fsdp_no_reshard",
        "shardkit FSDP per block + root, keep params until backward, forward prefetch",
        builders.build_fsdp,
        requires=_FSDP,
        defaults={"reshard_after_forward": False, **_PREFETCH},
    )
)
register(
    Strategy(
        "torch_fsdp2",
        "torch fully_shard (FSDP2) per block + root",
        builders.build_torch_fsdp2,
        requires=("torch.distributed.fsdp:fully_shard", "torch.distributed.device_mesh:DeviceMesh"),
        torch_comm=comm.fsdp_full_shard_bytes,
    )
)
register(
    Strategy(
        "torch_fsdp1",
        "torch FullyShardedDataParallel (FSDP1) per block + root",
        builders.build_torch_fsdp1,
        requires=("torch.distributed.fsdp:FullyShardedDataParallel",),
        torch_comm=comm.fsdp_full_shard_bytes,
    )
)
register(
    Strategy(
        "slowmo",
        "shardkit SlowMo DDP (local SGD between nodes + slow momentum)",
        builders.build_slowmo,
        requires=("shardkit.nn.slowmo:SlowMoDistributedDataParallel",),
        side_by_side=False,
    )
)

__all__ = [
    "Built",
    "OptimizerSpec",
    "OptionError",
    "Strategy",
    "all_strategies",
    "get_strategy",
    "register",
    "registered_names",
    "select",
]
