"""The strategies ``shardkit plan`` runs: its choice among the entries of :mod:`shardkit.strategies.registry`.

The planner builds each strategy from the user's model exactly as a training script would, through the same
registry entry that bench, the demo and the tests build it with, always passing the user's options (``{}``: the
constructor's own defaults). The accuracy tests run these same entries on real gloo processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardkit.strategies.builders import block_classes
from shardkit.strategies.registry import Built, OptionError, Strategy, get_strategy

#: The registry's strategies the planner plans by building them (by name).
PLANNED = ("ddp", "oss_ddp", "oss_sdp", "fsdp", "slowmo")

STRATEGIES: dict[str, Strategy] = {name: get_strategy(name) for name in PLANNED}

#: Strategies planned by a path of their own (pipeline parallelism), not by a registry builder.
PIPELINE = "smp"

#: FSDP options that move state to host memory (planned on the meta device only: :mod:`shardkit.plan.host`).
_OFFLOAD_OPTIONS = ("cpu_offload", "move_params_to_cpu", "move_grads_to_cpu")


def offload_options(strategy: str, options: Mapping[str, Any]) -> list[str]:
    """The options in ``options`` that offload ``strategy``'s state to host memory (empty for none)."""
    if strategy != "fsdp":
        return []
    return sorted(name for name in _OFFLOAD_OPTIONS if options.get(name))


def get(name: str) -> Strategy:
    """The registry entry of the planned strategy ``name``, or a clear error listing the ones the planner knows."""
    try:
        return STRATEGIES[name]
    except KeyError:
        known = ", ".join([*STRATEGIES, PIPELINE])
        raise OptionError(f"unknown strategy {name!r}; shardkit.plan knows: {known}") from None


__all__ = ["PIPELINE", "PLANNED", "STRATEGIES", "Built", "OptionError", "block_classes", "get", "offload_options"]
