"""Compatibility path for fairscale's testing helpers: ``DummyProcessGroup`` and the test harness (see
:mod:`shardkit.compat`)."""

from shardkit.distributed.dummy import DummyProcessGroup
from shardkit.distributed.spawn import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "DummyProcessGroup", "run_distributed"]
