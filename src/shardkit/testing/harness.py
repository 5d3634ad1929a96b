"""Test-facing name: the multi-process harness lives in :mod:`shardkit.distributed.spawn` (the planner and the
benchmarks launch their measurement worlds with it too); this module re-exports it."""

from shardkit.distributed.spawn import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
