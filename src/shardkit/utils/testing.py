"""Compatibility path: ``from shardkit.utils.testing import DummyProcessGroup`` (fairscale's location)."""

from shardkit.distributed.dummy import DummyProcessGroup
from shardkit.distributed.spawn import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "DummyProcessGroup", "run_distributed"]
