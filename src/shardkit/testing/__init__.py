"""Test tools: a multi-process gloo harness (the reference models live in :mod:`shardkit.models`)."""

from shardkit.distributed.spawn import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
