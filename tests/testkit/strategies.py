"""What the tests add to the strategy registry: an auto-wrap policy naming exactly which submodules become units.

Tests build every data-parallel strategy through :mod:`shardkit.strategies.registry`, as bench, the demo and the
planner do; a test that needs FSDP units at chosen places (not one per block) passes :func:`units_at` as the
``auto_wrap_policy`` option.
"""

from __future__ import annotations

from typing import Callable

from torch import nn


def units_at(*modules: nn.Module) -> Callable[[nn.Module, bool, int], bool]:
    """An auto-wrap policy (torch's form) that makes each of ``modules`` an FSDP unit of its own, and nothing else
    (the root becomes one when the builder wraps it)."""

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or any(module is unit for unit in modules)

    return policy
