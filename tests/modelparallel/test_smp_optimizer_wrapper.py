"""smp.DistributedOptimizer is the user's optimizer (its class, so a torch.optim.Optimizer): LR schedulers,
GradScaler, hooks and add_param_group work, and schedulers plus optimizer state survive a checkpoint round trip
in one process and in a 2-stage pipeline, giving the LRs and parameters of an uninterrupted run."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from smp_testlib import batch, mlp
from torch.optim import lr_scheduler

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit import max_state_diff
from testkit.smp import mse_step

STEPS, RESUME_AT = 6, 3

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS),
    "ReduceLROnPlateau": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0),
}


def _build(config: dict[str, Any], kind: str) -> tuple[smp.DistributedModel, torch.optim.Optimizer, Any]:
    smp.init(config)
    model = smp.DistributedModel(mlp())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return model, optimizer, SCHEDULERS[kind](optimizer)


def _train(model: Any, optimizer: Any, scheduler: Any, steps: range, lrs: list[float]) -> None:
    for s in steps:
        x, y = batch("mlp", 8, 100 * s)
        optimizer.zero_grad()
        loss = mse_step(model, x, y).reduce_mean()
        optimizer.step()
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            scheduler.step(loss.item() + 1.0)  # never improves after the first step: the LR halves each step
        else:
            scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])


def _uninterrupted(config: dict[str, Any], kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, optimizer, scheduler = _build(config, kind)
    lrs: list[float] = []
    try:
        _train(model, optimizer, scheduler, range(STEPS), lrs)
        return lrs, model.state_dict()
    finally:
        smp.reset()


def _resumed(config: dict[str, Any], kind: str, partial: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, optimizer, scheduler = _build(config, kind)
    lrs: list[float] = []
    try:
        _train(model, optimizer, scheduler, range(RESUME_AT), lrs)
        saved = copy.deepcopy(
            {
                "model": model.local_state_dict() if partial else model.state_dict(),
                "optimizer": optimizer.local_state_dict() if partial else optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            }
        )
    finally:
        smp.reset()
    model, optimizer, scheduler = _build(config, kind)  # a fresh job
    try:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        assert optimizer.param_groups[0]["lr"] == lrs[-1]  # before the partition already
        _train(model, optimizer, scheduler, range(RESUME_AT, STEPS), lrs)
        return lrs, model.state_dict()
    finally:
        smp.reset()


def _reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain torch, one process, whole batch."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = SCHEDULERS[kind](optimizer)
    lrs = []
    for s in range(STEPS):
        x, y = batch("mlp", 8, 100 * s)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            scheduler.step(loss.item() + 1.0)
        else:
            scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs, model.state_dict()


def _all_schedulers(rank: int, world_size: int, config: dict[str, Any], partial: bool) -> dict[str, Any]:
    return {kind: (_uninterrupted(config, kind), _resumed(config, kind, partial)) for kind in SCHEDULERS}


def _check(results: dict[str, Any]) -> None:
    for kind, ((lrs, weights), (resumed_lrs, resumed_weights)) in results.items():
        ref_lrs, ref_weights = _reference(kind)
        assert lrs == resumed_lrs == pytest.approx(ref_lrs, rel=1e-12), kind
        assert len(set(lrs)) > 1, kind  # the scheduler did change the LR
        assert max_state_diff(weights, resumed_weights) == 0.0, kind  # the round trip changes nothing
        assert max_state_diff(weights, ref_weights) < 1e-5, kind


def test_schedulers_across_a_checkpoint_single_process() -> None:
    _check(_all_schedulers(0, 1, {"partitions": 1, "microbatches": 2}, partial=False))


@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_schedulers_across_a_checkpoint_in_a_two_stage_pipeline(partial: bool) -> None:
    config = {"partitions": 2, "microbatches": 2}
    for result in run_distributed(_all_schedulers, 2, config, partial, timeout_s=180):
        _check(result)


@pytest.fixture
def single() -> Any:
    smp.init({"partitions": 1, "microbatches": 2})
    try:
        yield
    finally:
        smp.reset()


def test_is_the_users_optimizer(single: None) -> None:
    model = smp.DistributedModel(mlp())
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = smp.DistributedOptimizer(inner)
    assert isinstance(optimizer, torch.optim.AdamW) and isinstance(optimizer, torch.optim.Optimizer)
    assert isinstance(optimizer, smp.DistributedOptimizer) and type(optimizer).__name__ == "AdamW"
    assert optimizer.param_groups is inner.param_groups and optimizer.state is inner.state
    assert optimizer.optimizer is inner
    assert model.get_module() is model.module
    shallow = copy.copy(optimizer)  # a view with its own attributes, as for any optimizer
    assert type(shallow) is type(optimizer) and shallow.param_groups == optimizer.param_groups
    assert shallow.optimizer is inner and shallow.local_state_dict()["param_groups"][0]["lr"] == 1e-3
    with pytest.raises(TypeError, match=r"already an smp\.DistributedOptimizer"):
        smp.DistributedOptimizer(optimizer)
    with pytest.raises(TypeError, match=r"wraps a torch\.optim\.Optimizer"):
        smp.DistributedOptimizer(model)  # type: ignore[arg-type]


def test_hooks_param_groups_and_grad_scaler(single: None) -> None:
    model = smp.DistributedModel(mlp())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    extra = torch.nn.Parameter(torch.ones(3))
    optimizer.add_param_group({"params": [extra], "lr": 0.5})
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(opt is optimizer))
    scaler = smp.amp.GradScaler()

    @smp.step
    def scaled_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y) + extra.sum() * 0.0 + (extra * extra).sum()
        model.backward(scaler.scale(loss))
        return loss

    reference = mlp()
    ref_extra = torch.nn.Parameter(torch.ones(3))
    ref_opt = torch.optim.SGD([{"params": reference.parameters()}, {"params": [ref_extra], "lr": 0.5}], lr=0.05)
    for s in range(3):
        x, y = batch("mlp", 8, 100 * s)
        optimizer.zero_grad()
        scaled_step(model, x, y)
        scaler.step(optimizer)
        scaler.update()
        ref_opt.zero_grad()
        (F.mse_loss(reference(x), y) + (ref_extra * ref_extra).sum()).backward()
        ref_opt.step()
    assert calls == [True] * 3  # the hook ran once per step, on the wrapped optimizer
    assert torch.allclose(extra, ref_extra, atol=1e-6) and not torch.equal(extra.detach(), torch.ones(3))
    assert max_state_diff(model.state_dict(), reference.state_dict()) < 1e-5


def test_fp16_config_refuses_what_it_would_silently_get_wrong() -> None:
    smp.init({"partitions": 1, "fp16": True})
    try:
        with pytest.raises(ValueError, match=r"create smp\.DistributedModel before smp\.DistributedOptimizer"):
            smp.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1))
        model = smp.DistributedModel(torch.nn.Linear(4, 4))
        assert model.module.weight.dtype == torch.float16  # smp's FP16_Module: the model trains in FP16
        with pytest.raises(ValueError, match=r"unknown dynamic_loss_args \['window'\]"):
            smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, window=2)
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0)
        assert isinstance(optimizer, torch.optim.SGD) and optimizer.loss_scale == 8.0
        assert [p.dtype for p in optimizer.param_groups[0]["params"]] == [torch.float32] * 2  # the FP32 masters
        assert optimizer.fp16_groups[0][0] is model.module.weight
        with pytest.raises(ValueError, match=r"smp\.amp\.GradScaler with 'fp16': true"):
            smp.amp.GradScaler()  # a second scaler would unscale masters without gradients
        smp.amp.GradScaler(enabled=False).unscale_(optimizer)  # a disabled one (enabled=args.amp) does nothing
    finally:
        smp.reset()
