"""Fixtures of the smp tests."""

from collections.abc import Iterator

import pytest

import shardkit.modelparallel as smp


@pytest.fixture
def single() -> Iterator[None]:
    """smp set up in this process alone (one partition, two micro-batches), and reset afterwards."""
    smp.reset()
    smp.init({"partitions": 1, "microbatches": 2})
    try:
        yield
    finally:
        smp.reset()
