"""Test tools: a multi-process gloo harness and reference models for parity tests."""

from shardkit.testing.harness import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
