"""Tied parameters stay in one unit: refuse a unit that would shard a parameter another unit already shards.

When two modules share a parameter (an embedding tied to the output projection) and they end up in different
units, each unit shards the parameter on its own: the first unit replaces it by its shard, while the second still
sees the original tensor and shards a second copy. The copies then train apart with no error, from the second
step on. Each unit therefore *claims* the parameters it shards, in a registry keyed weakly by the parameter
object (it keeps neither the parameter nor the unit alive), and a new unit that finds one of its parameters
claimed by another unit raises before it changes anything.

- Nested units never claim the same parameter twice: an inner unit removes its parameters from the module tree,
  so the outer unit only meets a claimed parameter through a second module that still holds it, which is exactly
  a split tie.
- A claim ends with its unit, and also when the parameter is registered again where the unit found it (a failed
  ``auto_wrap`` restores the model that way), so wrapping again after an error works.

The registry is the one module-level state of the package; it holds weak references only, so it never leaks.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.nn.fsdp.flat_param import ParamLocation
from shardkit.nn.fsdp.param_group import collect_params


@dataclass(frozen=True)
class Claim:
    """Which unit shards a parameter, and where that unit found it."""

    #: The FullyShardedDataParallel instance that shards the parameter.
    unit: weakref.ReferenceType[nn.Module]
    #: Class name of the module that unit wraps.
    wrapped_class: str
    #: The parameter's path inside that module (``"weight"``, ``"embed.weight"``).
    param_path: str
    #: The submodule the parameter was registered on, and under which attribute.
    holder: weakref.ReferenceType[nn.Module]
    holder_class: str
    attr: str

    def is_live(self, param: nn.Parameter) -> bool:
        """False once the unit is gone, or once ``param`` is registered again where the unit took it from."""
        unit, holder = self.unit(), self.holder()
        if unit is None or holder is None:
            return False
        return holder._parameters.get(self.attr) is not param


_CLAIMS: WeakIdKeyDictionary = WeakIdKeyDictionary()

Owners = Sequence[tuple[ParamLocation, nn.Parameter]]


def check_unclaimed(module: nn.Module, is_unit: Callable[[nn.Module], bool]) -> Owners:
    """The parameters a new unit around ``module`` would shard; raise ``ValueError`` if another unit shards one.

    Call before changing anything; pass the result to :func:`claim` once the unit is built.
    """
    owners, _ = collect_params(module, is_unit)
    for loc, param in owners:
        found = _CLAIMS.get(param)
        if isinstance(found, Claim) and found.is_live(param):
            raise ValueError(_split_tie_message(module, loc, found))
    return owners


def claim(unit: nn.Module, module: nn.Module, owners: Iterable[tuple[ParamLocation, nn.Parameter]]) -> None:
    """Record that ``unit`` (wrapping ``module``) now shards ``owners``."""
    unit_ref = weakref.ref(unit)
    for loc, param in owners:
        holder = loc.module
        _CLAIMS[param] = Claim(
            unit_ref, type(module).__name__, loc.fqn, weakref.ref(holder), type(holder).__name__, loc.attr
        )


def claim_of(param: nn.Parameter) -> Optional[Claim]:
    """The live claim on ``param``, if a unit shards it."""
    found = _CLAIMS.get(param)
    return found if isinstance(found, Claim) and found.is_live(param) else None


def _split_tie_message(module: nn.Module, loc: ParamLocation, found: Claim) -> str:
    holder = type(loc.module).__name__
    here = f"{holder} '{loc.module_path}'" if loc.module_path else f"the {holder} being wrapped"
    other_unit = found.unit()
    where = next((f" at '{path}'" for path, sub in module.named_modules() if sub is other_unit and path), "")
    return (
        f"FullyShardedDataParallel({type(module).__name__}): parameter '{loc.fqn}' is tied "
        f"to parameter '{found.param_path}' of the {found.holder_class} that another FullyShardedDataParallel unit "
        f"(wrapping {found.wrapped_class}{where}) already shards; here it belongs to {here}. A tied parameter split "
        "across two units is sharded twice and the copies silently train apart. Keep every module that uses it in "
        f"one unit: do not wrap the {found.holder_class} or the {holder} on its own, wrap a module that contains "
        "both (auto_wrap does this by itself). This call changed nothing."
    )


__all__ = ["Claim", "check_unclaimed", "claim", "claim_of"]
