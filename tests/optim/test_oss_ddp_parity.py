"""OSS under torch DDP trains exactly like plain DDP with the unwrapped optimizer, at world sizes 1, 2 and 4."""

from __future__ import annotations

import pytest
import torch
from oss_testlib import ddp_pair

from shardkit.optim import OSS
from shardkit.testing import run_distributed
from testkit import average_grads, max_param_diff, tiny_model, train_harness_model

SCENARIOS = [
    # (model, optimizer, gradient accumulation, freeze half the parameters)
    ("lm", "sgd", 1, False),
    ("lm", "adamw", 1, False),
    ("nested", "adamw", 2, False),
    ("nested", "sgd", 2, False),
    ("lm", "adamw", 1, True),
]


def _parity_suite(rank: int, world_size: int) -> dict[str, float]:
    diffs = {}
    for name, optim, accumulate, freeze in SCENARIOS:
        ref_model, oss_model, ref_opt, oss_opt = ddp_pair(name, optim, freeze)
        assert oss_opt.world_size == world_size and oss_opt.rank == rank
        for model, opt in ((ref_model, ref_opt), (oss_model, oss_opt)):
            train_harness_model(name, model, opt, rank, range(3), accumulate)
        key = f"{name}-{optim}-acc{accumulate}-{'frozen' if freeze else 'all'}"
        diffs[key] = max_param_diff(ref_model, oss_model)
        # The shards really are split: this rank's optimizer holds state only for what it owns.
        owned = {p for p, r in oss_opt.param_to_rank.items() if r == rank}
        assert set(oss_opt.optim.state) <= owned
        assert all(p.requires_grad for p in oss_opt.param_to_rank)
        diffs[key + "-moved"] = max_param_diff(tiny_model(name), oss_model)
    return diffs


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_oss_matches_ddp(world_size: int) -> None:
    for rank_diffs in run_distributed(_parity_suite, world_size):
        for key, diff in rank_diffs.items():
            if key.endswith("-moved"):
                assert diff > 1e-4, f"{key}: training did not change the parameters"
            else:
                assert diff <= 1e-6, f"{key}: OSS drifted from DDP by {diff}"


def _refresh_trainable(rank: int, world_size: int) -> list[float]:
    """Freeze, then unfreeze, parameters between steps: state follows its parameter to the new owner.

    Freezing the largest tensor moves three others from rank 1 to rank 0, with their AdamW state.
    """
    ref_model, oss_model = tiny_model("nested"), tiny_model("nested")
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    oss_opt = OSS(oss_model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    owners_before = dict(oss_opt.param_to_rank)
    diffs = []
    for phase, frozen in enumerate([(), (4, 5), ()]):
        for model in (ref_model, oss_model):
            for i, p in enumerate(model.parameters()):
                p.requires_grad_(i not in frozen)
        if phase == 1:
            oss_opt.refresh_trainable()
            assert len(oss_opt.param_to_rank) == len(list(oss_model.parameters())) - 2
            if world_size > 1:
                assert oss_opt.param_to_rank != {p: owners_before[p] for p in oss_opt.param_to_rank}
        # phase 2 relies on step() noticing the change by itself
        for model, opt in ((ref_model, ref_opt), (oss_model, oss_opt)):
            steps = range(2 * phase, 2 * phase + 2)
            train_harness_model("nested", model, opt, rank, steps, after_backward=lambda m=model: average_grads(m))
        diffs.append(max_param_diff(ref_model, oss_model))
    return diffs


@pytest.mark.parametrize("world_size", [2])
def test_refresh_trainable_keeps_parity(world_size: int) -> None:
    for diffs in run_distributed(_refresh_trainable, world_size):
        assert max(diffs) <= 1e-6, diffs
