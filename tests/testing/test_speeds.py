"""The speed markers: what the source walk guesses, and the refusal that keeps a wrong ``unit`` guess from hiding."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch.distributed as dist

from shardkit.distributed import DummyProcessGroup
from shardkit.testing import run_distributed
from testkit.speeds import STARTED, reached_speed


def _spawns(rank: int, world_size: int) -> None:  # never run: only its source is read
    run_distributed(_spawns, 2)


@functools.cache
def _cached_job() -> None:
    _spawns(0, 1)


def _two_hops_to_the_harness() -> None:
    _cached_job()


def _one_rank() -> int:
    return DummyProcessGroup(rank=0, size=1).size()


def _pure() -> int:
    return sum(range(3))


def test_the_walk_follows_helpers_and_decorators_to_the_harness() -> None:
    assert reached_speed((_spawns,)) == "multi"
    assert reached_speed((_two_hops_to_the_harness,)) == "multi"  # through a functools.cache wrapper
    assert reached_speed((_one_rank,)) == "single"
    assert reached_speed((_pure,)) == "unit"
    assert reached_speed((_pure, _one_rank)) == "single"  # a fixture's speed counts as the test's


def test_this_file_is_marked_by_the_walk(request: pytest.FixtureRequest) -> None:
    # This test's own source names nothing slow: unit, although the module imports the harness.
    assert request.node.get_closest_marker("unit") is not None


@pytest.mark.unit  # by hand: the walk would call it single, for the names it tries
def test_a_unit_test_may_not_start_a_subprocess_or_a_process_group(request: pytest.FixtureRequest) -> None:
    with pytest.raises(RuntimeError, match="a unit test may not start a subprocess"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    with pytest.raises(RuntimeError, match="a unit test may not start a process group"):
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    # Refused and recorded: the teardown would fail this test for them.
    assert request.node.stash[STARTED] == ["a subprocess", "a process group"]
    request.node.stash[STARTED].clear()
