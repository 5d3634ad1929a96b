"""FSDP trains exactly like torch DDP (fp32, allclose 1e-5) on the reference models."""

from __future__ import annotations

import itertools

import pytest
from fsdp_testlib import run_parity

from shardkit.testing import run_distributed

MODELS = ["lm", "nested", "batchnorm", "moe"]


def _sweep(rank: int, world_size: int, name: str) -> None:
    # Every wrapping / resharding / flattening combination, in one process group to keep start-up cheap.
    for nested, reshard, flatten in itertools.product([True, False], [True, False], [True, False]):
        run_parity(rank, world_size, name, nested, reshard_after_forward=reshard, flatten_parameters=flatten)


@pytest.mark.parametrize("name", MODELS)
def test_parity_world2_all_settings(name: str) -> None:
    run_distributed(_sweep, 2, name)


def _world_sizes_1_and_4(rank: int, world_size: int) -> None:
    for name in MODELS:
        run_parity(rank, world_size, name, nested=True)


@pytest.mark.parametrize("world_size", [1, 4])
def test_parity_other_world_sizes(world_size: int) -> None:
    run_distributed(_world_sizes_1_and_4, world_size)


def _accumulation(rank: int, world_size: int) -> None:
    for name, use_no_sync, reshard in [("nested", True, True), ("nested", False, False), ("lm", True, False)]:
        run_parity(
            rank, world_size, name, nested=True, micro_batches=2, use_no_sync=use_no_sync, reshard_after_forward=reshard
        )
    run_parity(rank, world_size, "moe", nested=True, micro_batches=3, use_no_sync=True, flatten_parameters=False)


def test_gradient_accumulation_with_and_without_no_sync() -> None:
    run_distributed(_accumulation, 2)
