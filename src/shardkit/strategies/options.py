"""What a strategy builder is given and returns, and the checks every builder runs on its options first.

A builder gets the unwrapped model, an :class:`OptimizerSpec`, a process group (``None``: the default group), the
strategy's options (the wrapper constructor's keyword arguments) and the node topology (``None`` unless the caller
describes nodes). It returns :data:`Built`, ``(model, optimizer, after_step)``, for the loop
``loss_fn(model(x), y).backward(); optimizer.step(); after_step(); optimizer.zero_grad()``.

Options are checked against the constructor's signature before anything is built, so a misspelt option is a clear
:class:`OptionError` naming the valid ones, with nothing built or half-applied.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

#: ``(wrapped model, optimizer, after_step)``: ``after_step()`` runs right after every ``optimizer.step()``.
Built = tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]

#: Arguments a builder fills in itself (the module, the parameters, the groups): never a user's option.
_FILLED_BY_BUILDER = frozenset({"self", "module", "params", "sharded_optimizer", "process_group", "group"})


class OptionError(ValueError):
    """A strategy option that the strategy does not take, or an unknown strategy."""


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class and its keyword arguments, so each strategy can build (or shard) it its own way.

    ``param_groups`` (optional) turns the model into the optimizer's parameter groups (per-group learning rates,
    say); by default the optimizer takes ``model.parameters()``.
    """

    cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    param_groups: Optional[Callable[[nn.Module], Any]] = None

    def params(self, model: nn.Module) -> Any:
        """What the optimizer is built over: ``param_groups(model)``, or ``model.parameters()``."""
        return self.param_groups(model) if self.param_groups is not None else model.parameters()

    def make(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The plain, unsharded optimizer over ``params`` (tensors or parameter-group dicts)."""
        return self.cls(params, **self.kwargs)


def nothing() -> None:
    """The ``after_step`` of a strategy with nothing to do after the optimizer's step."""
    return None


def check_options(strategy: str, target: Any, options: Mapping[str, Any], extra: tuple[str, ...] = ()) -> None:
    """Refuse any of ``options`` that ``target``'s signature (plus ``extra``) does not take, naming the valid ones."""
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = {name for name, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL} | set(extra)
    known -= _FILLED_BY_BUILDER
    unknown = sorted(set(options) - known)
    if unknown:
        raise OptionError(
            f"strategy {strategy!r} has no option {', '.join(map(repr, unknown))}; its options are "
            f"{', '.join(sorted(known))}"
        )


def split_nested(options: Mapping[str, Any], key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Options for the wrapper, and the nested ``options[key]`` dict (OSS's own options under ``"oss"``)."""
    rest = dict(options)
    nested = rest.pop(key, None) or {}
    if not isinstance(nested, Mapping):
        raise OptionError(f"strategy option {key!r} must be a dict of keyword arguments, got {type(nested).__name__}")
    return rest, dict(nested)


def hybrid_topology(strategy: str, options: dict[str, Any], topology: Optional[Any]) -> Optional[Any]:
    """The node topology when the option ``hybrid=True`` (popped) asks to shard inside nodes, else None."""
    if not options.pop("hybrid", False):
        return None
    if topology is None:
        raise OptionError(f"strategy {strategy!r} with hybrid=True needs nprocs_per_node (the ranks of one node)")
    return topology


def enum_option(options: dict[str, Any], key: str, kind: type[enum.Enum], strategy: str) -> None:
    """Turn ``options[key]`` given by name (as JSON and the command line give it) into the member of ``kind``."""
    value = options.get(key)
    if not isinstance(value, str):
        return
    try:
        options[key] = kind[value]
    except KeyError:
        names = ", ".join(member.name for member in kind)
        raise OptionError(f"{strategy} {key} must be one of {names}") from None
