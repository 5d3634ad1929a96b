"""Compatibility path: the multi-process harness moved to :mod:`shardkit.distributed.spawn` (the planner and the
benchmarks launch their measurement worlds with it too); this module re-exports it."""

from shardkit.distributed.spawn import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
