"""The registry of data-parallel strategies that ``shardkit bench`` and ``shardkit demo`` run side by side.

A strategy is a small builder: given a freshly built model, an optimizer class with its keyword arguments and
a process group (inside an initialised ``torch.distributed``), it returns ``(wrapped_model, optimizer)`` ready
for the plain loop ``loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()``.

Strategies whose implementation has not landed yet (their import fails) are listed as not available instead
of failing; the demo and the benchmark pick them up as soon as their modules exist.

Adding a strategy is one :func:`register` call next to the others::

    def _build_mine(model, optim, group):
        model = MyWrapper(model, process_group=group)
        return model, optim.make(model.parameters())

    register(Strategy("mine", "my wrapper + AdamW", _build_mine, requires=("my.package",)))
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from shardkit.distributed import comm_formulas as comm

Group = Any  # a torch.distributed ProcessGroup (kept loose: the builders pass it straight through)


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class and its keyword arguments, so each strategy can build (or shard) it its own way."""

    cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def make(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The plain, unsharded optimizer over ``params``."""
        return self.cls(params, **self.kwargs)


Builder = Callable[[nn.Module, OptimizerSpec, Group], "tuple[nn.Module, torch.optim.Optimizer]"]


@dataclass(frozen=True)
class Strategy:
    """One way of training data-parallel.

    ``requires`` names modules (``"pkg.mod"`` or ``"pkg.mod:attr"``) whose import must succeed for the strategy
    to be available. ``torch_comm`` estimates the bytes per step (per rank, on the wire, ring algorithms) of
    collectives that torch issues internally, which :func:`~shardkit.distributed.count_comm_bytes` cannot
    see; ``None`` means every collective of the strategy goes through shardkit's counted collectives.
    """

    name: str
    description: str
    build: Builder
    requires: tuple[str, ...] = ()
    torch_comm: Optional[Callable[[nn.Module, int], int]] = None

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
    """Every registered strategy, available or not, in registration order (DDP, the baseline, first)."""
    return list(_REGISTRY.values())


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; an unknown name raises an error listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known strategies: {', '.join(_REGISTRY)}") from None


def select(names: Optional[Iterable[str]] = None) -> tuple[list[Strategy], dict[str, str]]:
    """Available strategies among ``names`` (all registered ones by default), and ``{name: reason}`` for the rest."""
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


# --- builders ------------------------------------------------------------------------------------------------


def _torch_ddp(model: nn.Module, group: Group) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=group)


def _build_ddp(model: nn.Module, optim: OptimizerSpec, group: Group) -> tuple[nn.Module, torch.optim.Optimizer]:
    wrapped = _torch_ddp(model, group)
    return wrapped, optim.make(wrapped.parameters())


def _build_zero_torch(model: nn.Module, optim: OptimizerSpec, group: Group) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    wrapped = _torch_ddp(model, group)
    opt = ZeroRedundancyOptimizer(
        wrapped.parameters(), optimizer_class=optim.cls, process_group=group, **dict(optim.kwargs)
    )
    return wrapped, opt


def _build_oss_ddp(model: nn.Module, optim: OptimizerSpec, group: Group) -> tuple[nn.Module, torch.optim.Optimizer]:
    # start-up cost: the launching process selects strategies; only the workers that build one import it
    from shardkit.optim import OSS

    wrapped = _torch_ddp(model, group)
    return wrapped, OSS(wrapped.parameters(), optim=optim.cls, group=group, **dict(optim.kwargs))


def _build_oss_sdp(model: nn.Module, optim: OptimizerSpec, group: Group) -> tuple[nn.Module, torch.optim.Optimizer]:
    # start-up cost: the launching process selects strategies; only the workers that build one import it
    from shardkit.nn import ShardedDataParallel
    from shardkit.optim import OSS

    opt = OSS(model.parameters(), optim=optim.cls, group=group, **dict(optim.kwargs))
    return ShardedDataParallel(model, opt, process_group=group), opt


def _wrap_blocks(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Wrap every transformer block of ``model`` (a ``TransformerLM``), then the root, with ``wrap``."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"FSDP strategies expect a TransformerLM with a .blocks ModuleList, got {type(model).__name__}")
    for index, block in enumerate(blocks):
        blocks[index] = wrap(block)
    return wrap(model)


def _build_fsdp(
    model: nn.Module, optim: OptimizerSpec, group: Group, *, reshard_after_forward: bool
) -> tuple[nn.Module, torch.optim.Optimizer]:
    # start-up cost: the launching process selects strategies; only the workers that build one import it
    from shardkit.nn import FullyShardedDataParallel
    from shardkit.nn.fsdp import BackwardPrefetch

    def wrap(module: nn.Module) -> nn.Module:
        # Prefetch one block ahead in both directions (torch FSDP2 prefetches in backward by default).
        return FullyShardedDataParallel(
            module,
            process_group=group,
            reshard_after_forward=reshard_after_forward,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=True,
        )

    wrapped = _wrap_blocks(model, wrap)
    return wrapped, optim.make(wrapped.parameters())


def _build_torch_fsdp2(model: nn.Module, optim: OptimizerSpec, group: Group) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type)

    def wrap(module: nn.Module) -> nn.Module:
        fully_shard(module, mesh=mesh)
        return module

    wrapped = _wrap_blocks(model, wrap)
    return wrapped, optim.make(wrapped.parameters())


def _build_torch_fsdp1(model: nn.Module, optim: OptimizerSpec, group: Group) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    device = next(model.parameters()).device

    def wrap(module: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(module, process_group=group, device_id=device)

    wrapped = _wrap_blocks(model, wrap)
    return wrapped, optim.make(wrapped.parameters())


register(Strategy("ddp", "torch DDP + AdamW (baseline)", _build_ddp, torch_comm=comm.ddp_allreduce_bytes))
register(
    Strategy(
        "zero_torch",
        "torch DDP + torch ZeroRedundancyOptimizer",
        _build_zero_torch,
        torch_comm=comm.ddp_plus_param_broadcast_bytes,
    )
)
register(
    Strategy(
        "oss_ddp",
        "torch DDP + shardkit OSS (ZeRO-1)",
        _build_oss_ddp,
        requires=("shardkit.optim.zero1:OSS",),
        torch_comm=comm.ddp_allreduce_bytes,
    )
)
register(
    Strategy(
        "oss_sdp",
        "shardkit OSS + ShardedDataParallel (ZeRO-2)",
        _build_oss_sdp,
        requires=("shardkit.optim.zero1:OSS", "shardkit.nn.sharded_ddp:ShardedDataParallel"),
    )
)
register(
    Strategy(
        "fsdp",
        "shardkit FSDP per block + root, reshard after forward, prefetch one block ahead (ZeRO-3)",
        functools.partial(_build_fsdp, reshard_after_forward=True),
        requires=("shardkit.nn.fsdp:FullyShardedDataParallel",),
    )
)
register(
    Strategy(
        "fsdp_no_reshard",
        "shardkit FSDP per block + root, keep params until backward, forward prefetch",
        functools.partial(_build_fsdp, reshard_after_forward=False),
        requires=("shardkit.nn.fsdp:FullyShardedDataParallel",),
    )
)
register(
    Strategy(
        "torch_fsdp2",
        "torch fully_shard (FSDP2) per block + root",
        _build_torch_fsdp2,
        requires=("torch.distributed.fsdp:fully_shard", "torch.distributed.device_mesh:DeviceMesh"),
        torch_comm=comm.fsdp_full_shard_bytes,
    )
)
register(
    Strategy(
        "torch_fsdp1",
        "torch FullyShardedDataParallel (FSDP1) per block + root",
        _build_torch_fsdp1,
        requires=("torch.distributed.fsdp:FullyShardedDataParallel",),
        torch_comm=comm.fsdp_full_shard_bytes,
    )
)
