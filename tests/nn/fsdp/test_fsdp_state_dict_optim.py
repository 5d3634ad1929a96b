"""Optimizer state of FSDP: gathered in full (unwrapped layout, several param groups) and cut back into shards."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup, broadcast_object
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.testing import models as M
from shardkit.testing import run_distributed

GLOBAL_BATCH = 4


def build_lm(seed: int, group: Any = None) -> FSDP:
    model = M.build("lm", seed=seed)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, process_group=group)
    return FSDP(model, process_group=group)


def grouped(named: Iterable[tuple[str, nn.Parameter]], kind: str) -> torch.optim.Optimizer:
    """Two param groups, as a user builds them: the blocks at one learning rate, everything else at another."""
    named = list(named)
    groups = [
        {"params": [p for n, p in named if n.startswith("blocks.")], "lr": 0.02},
        {"params": [p for n, p in named if not n.startswith("blocks.")], "lr": 0.05},
    ]
    if kind == "adam":
        # Adam turns rounding noise on zero-gradient parameters (the key bias) into full-size steps unless eps
        # dominates it; the larger eps keeps the sharded and unsharded runs comparable.
        return torch.optim.Adam(groups, lr=0.01, eps=1e-3)
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0, world_size: int = 1) -> None:
    per_rank = GLOBAL_BATCH // world_size
    for step in steps:
        x, y = M.lm_batch(M.LMConfig(), GLOBAL_BATCH, seed=500 + step)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        M.TransformerLM.loss_fn(model(x[rows]), y[rows]).backward()
        opt.step()


def _gather_and_reshard(rank: int, world_size: int) -> None:
    for kind in ("sgd", "adam"):
        _gather_and_reshard_one(rank, world_size, kind)


def _gather_and_reshard_one(rank: int, world_size: int, kind: str) -> None:
    model = build_lm(seed=0)
    opt = grouped(model.named_parameters(), kind)
    train(model, opt, range(2), rank, world_size)
    full_sd = model.state_dict()
    full_osd = model.gather_full_optim_state_dict(opt)
    assert (full_osd is None) == (rank != 0)
    full_osd = broadcast_object(full_osd)

    # 1. A plain optimizer over the unwrapped model takes the gathered state as it is.
    plain = M.build("lm", seed=1)
    plain.load_state_dict(full_sd)
    plain_opt = grouped(plain.named_parameters(), kind)
    names = [n for n, _ in plain.named_parameters()]
    assert [g["param_names"] for g in full_osd["param_groups"]] == [
        [n for n in names if n.startswith("blocks.")],
        [n for n in names if not n.startswith("blocks.")],
    ]
    assert [g["lr"] for g in full_osd["param_groups"]] == [0.02, 0.05]
    plain_opt.load_state_dict(full_osd)

    # 2. A fresh wrapped model resumes from the full dicts.
    resumed = build_lm(seed=1)
    resumed.load_state_dict(full_sd)
    resumed_opt = grouped(resumed.named_parameters(), kind)
    resumed_opt.load_state_dict(resumed.get_shard_from_optim_state_dict(full_osd))

    train(model, opt, range(2, 4), rank, world_size)
    train(resumed, resumed_opt, range(2, 4), rank, world_size)
    train(plain, plain_opt, range(2, 4))
    want = plain.state_dict()
    for sd, what in ((model.state_dict(), "uninterrupted"), (resumed.state_dict(), "resumed")):
        for key, value in want.items():
            torch.testing.assert_close(
                sd[key], value, atol=2e-5, rtol=1e-5, msg=lambda m, k=key, w=what: f"{w} {k}: {m}"
            )


def test_full_optimizer_state_continues_training_identically() -> None:
    run_distributed(_gather_and_reshard, 2)


def test_optimizer_state_of_plain_model_loads_by_position_into_single_process_fsdp() -> None:
    group = DummyProcessGroup(rank=0, size=1)
    plain = M.build("lm", seed=0)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)  # no names recorded: matched by position
    train(plain, plain_opt, range(2))
    model = build_lm(seed=1, group=group)
    model.load_state_dict(plain.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(model.get_shard_from_optim_state_dict(plain_opt.state_dict()))
    train(plain, plain_opt, range(2, 4))
    train(model, opt, range(2, 4))
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=1e-5, rtol=1e-5)


def test_optimizer_state_errors_name_the_problem() -> None:
    group = DummyProcessGroup(rank=0, size=1)
    model = build_lm(seed=0, group=group)
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="not a shard of this"):
        model.gather_full_optim_state_dict(stranger)
    opt = grouped(model.named_parameters(), "sgd")
    train(model, opt, range(1))
    full_osd = model.gather_full_optim_state_dict(opt)
    assert full_osd is not None
    full_osd["param_groups"][0]["param_names"][0] = "blocks.7.qkv.weight"
    with pytest.raises(ValueError, match=r"blocks\.7\.qkv\.weight"):
        model.get_shard_from_optim_state_dict(full_osd)
    two_groups = torch.optim.SGD(M.build("lm").parameters(), lr=0.1).state_dict()
    two_groups["param_groups"].append({**two_groups["param_groups"][0], "params": []})
    with pytest.raises(ValueError, match="param_names"):
        model.get_shard_from_optim_state_dict(two_groups)
