"""Compatibility path: the strategy registry moved to :mod:`shardkit.strategies.registry`; re-exported here."""

from shardkit.strategies.registry import (
    Builder,
    Group,
    OptimizerSpec,
    Strategy,
    all_strategies,
    get_strategy,
    register,
    select,
)

__all__ = [
    "Builder",
    "Group",
    "OptimizerSpec",
    "Strategy",
    "all_strategies",
    "get_strategy",
    "register",
    "select",
]
