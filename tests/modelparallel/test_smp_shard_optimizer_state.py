"""``shard_optimizer_state``: each stage's optimizer state is split over its data-parallel replicas, training gives
the parameters and optimizer state of unsharded training, and the state survives a checkpoint round trip."""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
import torch
from smp_testlib import batch, mlp

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit import max_state_diff
from testkit.smp import mse_step

STEPS, RESUME_AT = 4, 2


def _steps(model: Any, optimizer: Any, scheduler: Any, steps: range) -> list[float]:
    losses = []
    for s in steps:
        x, y = batch("mlp", 8, 100 * s + smp.dp_rank())
        optimizer.zero_grad()
        losses.append(mse_step(model, x, y).reduce_mean().item())
        optimizer.step()
        scheduler.step()
    return losses


def _job(config: dict[str, Any], resume_from: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    smp.init(config)
    try:
        model = smp.DistributedModel(mlp())
        optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        first = 0
        if resume_from is not None:
            model.load_state_dict(resume_from["model"])
            optimizer.load_state_dict(resume_from["optimizer"])
            scheduler.load_state_dict(resume_from["scheduler"])
            first = RESUME_AT
        losses = _steps(model, optimizer, scheduler, range(first, STEPS if resume_from else RESUME_AT))
        middle = copy.deepcopy(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        )
        if resume_from is None:
            losses += _steps(model, optimizer, scheduler, range(RESUME_AT, STEPS))
        sharded = optimizer._smp_sharded  # the shards, to count what this rank keeps
        return {
            "losses": losses,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "partial": optimizer.local_state_dict(),
            "middle": middle,
            "kept": len(sharded.oss.optim.state) if sharded is not None else len(optimizer.state),
            "held": len([p for p in model.local_parameters() if p.numel()]),
        }
    finally:
        smp.reset()


def _compare(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    plain = _job(config)
    sharded = _job({**config, "shard_optimizer_state": True})
    resumed = _job({**config, "shard_optimizer_state": True}, resume_from=sharded["middle"])
    return {"plain": plain, "sharded": sharded, "resumed": resumed}


def _same_optimizer_state(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a["state"].keys() == b["state"].keys()
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]
    return max(
        max_state_diff({k: v for k, v in a["state"][i].items()}, {k: v for k, v in b["state"][i].items()})
        for i in a["state"]
    )


@pytest.mark.parametrize(
    ("world_size", "config"),
    [
        pytest.param(2, {"partitions": 1, "ddp": True, "microbatches": 2}, id="ws2-ddp"),
        pytest.param(4, {"partitions": 2, "ddp": True, "microbatches": 2}, id="ws4-2x2"),
        # two chunks per rank, most backwards run whole (B+W fused), the rest split
        pytest.param(4, {"partitions": 2, "ddp": True, "microbatches": 4, "pipeline": "zbv"}, id="ws4-2x2-zbv"),
    ],
)
def test_sharded_state_trains_like_unsharded_and_resumes(world_size: int, config: dict[str, Any]) -> None:
    results = run_distributed(_compare, world_size, config, timeout_s=240)
    for result in results:
        plain, sharded, resumed = result["plain"], result["sharded"], result["resumed"]
        assert sharded["losses"] == pytest.approx(plain["losses"], abs=1e-6)
        assert max_state_diff(sharded["model"], plain["model"]) < 1e-6
        assert _same_optimizer_state(sharded["optimizer"], plain["optimizer"]) < 1e-6
        assert _same_optimizer_state(sharded["partial"], plain["partial"]) < 1e-6
        # Each replica keeps part of its stage's state; together they keep all of it.
        assert 0 < sharded["kept"] < plain["kept"] == sharded["held"]
        # Resumed at RESUME_AT from the sharded state dict: the same as the uninterrupted sharded run.
        assert resumed["losses"] == pytest.approx(sharded["losses"][RESUME_AT:], abs=1e-7)
        assert max_state_diff(resumed["model"], sharded["model"]) < 1e-7
    for stage_results in (results[0::2], results[1::2]) if world_size == 4 else (results,):
        kept = sum(r["sharded"]["kept"] for r in stage_results)
        assert kept == stage_results[0]["plain"]["kept"]  # the replicas' shards cover the stage exactly once


def test_fused_lamb_with_sharded_state_is_refused() -> None:
    smp.init({"partitions": 1, "shard_optimizer_state": True})
    try:
        model = smp.DistributedModel(mlp())
        with pytest.raises(ValueError, match="FusedLamb's global gradient norm"):
            smp.DistributedOptimizer(smp.optimizers.FusedLamb(model.parameters()))
    finally:
        smp.reset()


def test_universal_checkpoint_of_sharded_state_is_refused(tmp_path: Any) -> None:
    from shardkit.checkpoint import save_checkpoint

    smp.init({"partitions": 1, "shard_optimizer_state": True})
    try:
        model = smp.DistributedModel(mlp())
        optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters()))
        with pytest.raises(ValueError, match="'shard_optimizer_state' are not supported yet"):
            save_checkpoint(tmp_path / "ckpt", step=0, model=model, optimizer=optimizer)
    finally:
        smp.reset()


def _optimizer_after_partition(rank: int, world_size: int) -> dict[str, Any]:
    """smp's documented pattern: the optimizer built over local_parameters() after the first step."""
    results = {}
    for shard in (False, True):
        smp.init({"partitions": 1, "ddp": True, "shard_optimizer_state": shard})
        try:
            model = smp.DistributedModel(mlp())
            x, _ = batch("mlp", 8, smp.dp_rank())
            with torch.no_grad():
                _forward_only(model, x)
            optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.local_parameters(), lr=0.01))
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
            losses = _steps(model, optimizer, scheduler, range(3))
            results[shard] = {"losses": losses, "model": model.state_dict()}
        finally:
            smp.reset()
    return results


@smp.step
def _forward_only(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def test_optimizer_built_after_the_partition_is_sharded_at_once() -> None:
    for result in run_distributed(_optimizer_after_partition, 2, timeout_s=120):
        assert result[True]["losses"] == pytest.approx(result[False]["losses"], abs=1e-6)
        assert max_state_diff(result[True]["model"], result[False]["model"]) < 1e-6
        assert result[True]["losses"][0] != result[True]["losses"][-1]  # it trained
