"""OSS + ShardedDataParallel against torch DDP with the plain optimizer: same gradients on the owners, same
parameters after every step (fp32, atol 1e-6), at world sizes 1, 2 and 4.

One process launch per world size runs every scenario (launches dominate the cost on two shared cores); a
failure lists each scenario that broke.
"""

from __future__ import annotations

import pytest
from sdp_testlib import Outcome, Scenario, run_scenario

from shardkit.testing import run_distributed

SCENARIOS: dict[str, Scenario] = {
    "lm-sgd": Scenario(model="lm", optim="sgd"),
    "lm-adamw": Scenario(model="lm", optim="adamw"),
    "lm-sgd-accumulate": Scenario(model="lm", optim="sgd", accumulate=3),
    "lm-adamw-accumulate": Scenario(model="lm", optim="adamw", accumulate=2),
    "lm-adamw-frozen-half": Scenario(model="lm", optim="adamw", freeze=True),
    "nested-sgd-flip": Scenario(model="nested", optim="sgd", flip_at=1),
    "nested-adamw-flip-manual": Scenario(
        model="nested", optim="adamw", flip_at=2, manual_refresh=True, sdp_kwargs={"auto_refresh_trainable": False}
    ),
    "unused-adamw": Scenario(optim="adamw", unused=True, steps=4),
    "unused-sgd-accumulate": Scenario(optim="sgd", unused=True, accumulate=2),
    "nested-two-optimizers": Scenario(model="nested", optim="sgd", two_optims="adamw"),
    "batchnorm-sgd": Scenario(model="batchnorm", optim="sgd"),
    "batchnorm-adamw-accumulate": Scenario(model="batchnorm", optim="adamw", accumulate=2),
    "lm-adamw-small-buckets": Scenario(model="lm", optim="adamw", sdp_kwargs={"reduce_buffer_size": 600}),
    "lm-sgd-no-buckets": Scenario(model="lm", optim="sgd", sdp_kwargs={"reduce_buffer_size": 0}),
}

ATOL = 1e-6


def _suite(rank: int, world_size: int) -> dict[str, Outcome]:
    return {name: run_scenario(rank, scenario) for name, scenario in SCENARIOS.items()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_matches_ddp(world_size: int) -> None:
    failures = []
    for rank, outcomes in enumerate(run_distributed(_suite, world_size)):
        for name, outcome in outcomes.items():
            if outcome.param_diff > ATOL or outcome.grad_diff > ATOL or outcome.grad_problems:
                failures.append(
                    f"{name} (rank {rank}): param diff {outcome.param_diff:.2e}, grad diff {outcome.grad_diff:.2e}, "
                    f"gradient placement problems: {outcome.grad_problems[:3]}"
                )
    assert not failures, "\n".join(failures)
