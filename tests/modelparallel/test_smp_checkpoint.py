"""Checkpoints: partial save -> load -> identical continued training; full save -> plain torch model and back."""

from __future__ import annotations

import os
from typing import Any

import torch
from smp_testlib import batch, loss_of, tiny_lm, train_steps

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from shardkit.testing.models import LMConfig, TransformerLM
from testkit import max_state_diff

CONFIG = {"partitions": 2, "microbatches": 2}


@smp.step
def predict(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _build(seed: int) -> tuple[smp.DistributedModel, smp.DistributedOptimizer]:
    smp.init(CONFIG)
    torch.manual_seed(seed)
    model = smp.DistributedModel(TransformerLM(LMConfig()))
    return model, smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _train(model: smp.DistributedModel, opt: Any, steps: range) -> list[float]:
    return train_steps(model, opt, "lm", 4, steps)


def _checkpoints(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    partial_path, full_path = os.path.join(directory, "partial.pt"), os.path.join(directory, "full.pt")
    model, opt = _build(seed=2)
    _train(model, opt, range(2))
    if smp.dp_rank() == 0:
        smp.save({"model": model.local_state_dict(), "opt": opt.local_state_dict()}, partial_path, partial=True)
        smp.save({"model": model.state_dict(), "opt": opt.state_dict()}, full_path, partial=False)
    smp.barrier()
    continued = _train(model, opt, range(2, 4))
    final = model.state_dict()
    x, _ = batch("lm", 4, 99)
    final_out = predict(model, x).concat()
    x8, _ = batch("lm", 8, 98)
    final_out8 = predict(model, x8).concat()  # new micro-batch shape: the stages discover its shapes
    held = sum(v.numel() for k, v in model.local_state_dict().items() if k != "_smp_is_partial")
    smp.reset()

    results: dict[str, Any] = {"files": sorted(os.listdir(directory)), "held": held}
    for kind, path, partial in (("partial", partial_path, True), ("full", full_path, False)):
        model, opt = _build(seed=7)  # different weights: only the checkpoint can make it match
        checkpoint = smp.load(path, partial=partial)
        model.load_state_dict(checkpoint["model"])  # before the partition: applied when it happens
        opt.load_state_dict(checkpoint["opt"])
        results[f"{kind}_loss_diff"] = max(abs(a - b) for a, b in zip(_train(model, opt, range(2, 4)), continued))
        results[f"{kind}_param_diff"] = max_state_diff(model.state_dict(), final)
        results[f"{kind}_out_diff"] = (predict(model, x).concat() - final_out).abs().max().item()
        smp.reset()

    # The full checkpoint is a plain torch checkpoint: the unwrapped model and optimizer load it as is.
    plain = tiny_lm()
    checkpoint = torch.load(full_path)
    plain.load_state_dict(checkpoint["model"])
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain_opt.load_state_dict(checkpoint["opt"])
    plain_losses = []
    for s in range(2, 4):
        xs, ys = batch("lm", 4, s)
        plain_opt.zero_grad()
        loss = loss_of("lm", plain(xs), ys)
        loss.backward()
        plain_opt.step()
        plain_losses.append(loss.item())
    results["plain_loss_diff"] = max(abs(a - b) for a, b in zip(plain_losses, continued))
    results["plain_out_diff"] = max(
        (plain(x) - final_out).abs().max().item(), (plain(x8) - final_out8).abs().max().item()
    )
    results["total"] = sum(v.numel() for v in plain.state_dict().values())
    return results


def test_partial_and_full_checkpoints(tmp_path: Any) -> None:
    for r in run_distributed(_checkpoints, 2, str(tmp_path)):
        assert r["files"] == ["full.pt", "partial.pt_0", "partial.pt_1"]
        assert r["held"] < r["total"]  # a partial checkpoint holds one stage's share
        for key in ("partial", "full", "plain"):
            assert r[f"{key}_loss_diff"] <= 1e-6, (key, r)
            assert r[f"{key}_out_diff"] <= 1e-6, (key, r)
        assert r["partial_param_diff"] <= 1e-6 and r["full_param_diff"] <= 1e-6, r
