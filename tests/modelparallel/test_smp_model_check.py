"""Ranks that built different models get one clear ValueError each, before anything is broadcast."""

from __future__ import annotations

import torch
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit.smp import mse_step


def _build(rank: int, case: str) -> nn.Module:
    torch.manual_seed(0)
    width = 16 + rank if case == "shape" else 16
    layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4)]
    if case == "extra" and rank == 1:
        layers.append(nn.Linear(4, 4))
    model = nn.Sequential(*layers)
    if case == "dtype" and rank == 1:
        model[2].double()
    return model


def _different_models(rank: int, world_size: int, config: dict[str, object]) -> dict[str, str]:
    messages = {}
    for case in ("shape", "extra", "dtype"):
        smp.init(config)
        model = smp.DistributedModel(_build(rank, case))
        before = {k: v.clone() for k, v in model.module.state_dict().items()}
        try:
            mse_step(model, torch.ones(4, 8), torch.zeros(4, 4))
            messages[case] = "no error"
        except ValueError as exc:
            messages[case] = str(exc)
        untouched = all(torch.equal(before[k], v) for k, v in model.module.state_dict().items())
        messages[case + "_untouched"] = str(untouched and not model.partitioned)
        smp.reset()
    return messages


def test_different_models_raise_on_every_rank_before_the_broadcast() -> None:
    for config in ({"partitions": 2, "microbatches": 2}, {"partitions": 1, "ddp": True}):
        results = run_distributed(_different_models, 2, config)
        for messages in results:
            assert (
                "smp.DistributedModel: the ranks hold different models: rank 0 has parameter '0.weight' [16, 8] "
                "torch.float32 where rank 1 has parameter '0.weight' [17, 8] torch.float32" in messages["shape"]
            ), messages["shape"]
            assert "parameter '3.weight' [4, 4] torch.float32 exists only on rank 1" in messages["extra"]
            assert (
                "rank 0 has parameter '2.weight' [4, 16] torch.float32 where rank 1 has parameter '2.weight' "
                "[4, 16] torch.float64" in messages["dtype"]
            )
            assert "Build the same model on every rank" in messages["shape"]
            assert all(messages[f"{case}_untouched"] == "True" for case in ("shape", "extra", "dtype"))
