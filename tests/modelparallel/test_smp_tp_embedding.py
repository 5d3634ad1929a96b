"""``smp.nn.DistributedEmbedding`` (issue 34): split along ``embedding_dim``; an ``nn.Embedding`` marked by
``smp.tensor_parallelism()`` is replaced by one holding its columns, and trains at TP 2 equal to plain torch, with
and without ``prescaled_batch``; the full state dict merges the columns back."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(32, 8, padding_idx=0), nn.Tanh(), nn.Linear(8, 4))


def _train(prescaled: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = _net()
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        net = _net()
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    plain = torch.optim.SGD(reference.parameters(), lr=0.5)
    parts, index = (smp.rdp_size(), smp.rdp_rank()) if prescaled else (smp.dp_size(), smp.dp_rank())

    @smp.step
    def train(model: smp.DistributedModel, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(ids), y)
        model.backward(loss)
        return loss

    losses, theirs = [], []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        ids, y = torch.randint(0, 32, (8, 5), generator=gen), torch.randn(8, 5, 4, generator=gen)
        optimizer.zero_grad()
        loss = train(model, ids.chunk(parts)[index], y.chunk(parts)[index]).reduce_mean().item()
        losses.append(sum(smp.allgather(loss, smp.DP_GROUP)) / smp.dp_size())
        optimizer.step()
        plain.zero_grad()
        ref_loss = F.mse_loss(reference(ids), y)
        ref_loss.backward()
        plain.step()
        theirs.append(ref_loss.item())
    merged = model.state_dict()
    errors = {name: (merged[name] - p.detach()).abs().max().item() for name, p in reference.state_dict().items()}
    return {
        "types": [type(m).__name__ for m in net],
        "local_shape": tuple(net[0].weight.shape),
        "losses": losses,
        "theirs": theirs,
        "errors": errors,
    }


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for prescaled in (False, True):
        smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled})
        try:
            out[prescaled] = _train(prescaled)
            try:
                smp.nn.DistributedEmbedding(10, 6, max_norm=1.0)
            except ValueError as exc:
                out["max_norm"] = str(exc)
        finally:
            smp.reset()
    return out


def test_distributed_embedding_at_tp2_trains_equal_to_plain_torch() -> None:
    for result in run_distributed(_worker, 2):
        assert "max_norm and sparse need whole rows" in result["max_norm"], result
        for prescaled in (False, True):
            run = result[prescaled]
            assert run["types"] == ["DistributedEmbedding", "Tanh", "DistributedLinear"], run
            assert run["local_shape"] == (32, 4), run
            for mine, theirs in zip(run["losses"], run["theirs"]):
                assert abs(mine - theirs) < 1e-6, (prescaled, run)
            assert max(run["errors"].values()) < 1e-6, (prescaled, run)
