"""Compatibility path: the worker-side runner moved to :mod:`shardkit.strategies.live`; re-exported here."""

from shardkit.strategies.live import (
    PHASES,
    Combined,
    LiveStrategy,
    LossFn,
    StrategyResult,
    agree_on_failures,
    combine,
    combine_all,
    paired_ratio,
    quiet_torch_deprecations,
)

__all__ = [
    "PHASES",
    "Combined",
    "LiveStrategy",
    "LossFn",
    "StrategyResult",
    "agree_on_failures",
    "combine",
    "combine_all",
    "paired_ratio",
    "quiet_torch_deprecations",
]
