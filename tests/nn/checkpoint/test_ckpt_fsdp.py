"""FullyShardedDataParallel(checkpoint_wrapper(block)): same training as the plain model, clean state dict keys."""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn import checkpoint_wrapper
from shardkit.testing import run_distributed


class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), BNBlock(), BNBlock(), nn.Linear(8, 2))


def train_sharded_vs_local(rank: int, world_size: int) -> list[str]:
    reference = build()
    model = copy.deepcopy(reference)
    for i in (1, 2):
        model[i] = FSDP(checkpoint_wrapper(model[i]))
    model = FSDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        data = torch.randn(world_size * 4, 8, generator=torch.Generator().manual_seed(step))
        mine = data[rank * 4 : (rank + 1) * 4]
        torch.manual_seed(100 + step)
        model(mine).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        # Reference: the mean of the per-rank losses, with the same dropout masks per rank's forward.
        # Each rank's batch statistics differ, so run the reference forward per rank's slice as the ranks do.
        ref_opt.zero_grad()
        for r in range(world_size):
            torch.manual_seed(100 + step)
            (reference(data[r * 4 : (r + 1) * 4]).pow(2).mean() / world_size).backward()
        ref_opt.step()
    full = model.state_dict()
    expected = reference.state_dict()
    assert list(full) == list(expected), (list(full), list(expected))
    for key, value in expected.items():
        if "running" in key or "num_batches" in key:
            continue  # each rank's BatchNorm saw only its own batches
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=key)
    return list(full)


def test_fsdp_of_checkpoint_wrapper_matches_local_training() -> None:
    keys = run_distributed(train_sharded_vs_local, 2)
    assert keys[0] == keys[1] and not any("_checkpoint_wrapped_module" in k for k in keys[0])
