"""Issue 32, round two of a new user's everyday mistakes (the sweep): each tried on 2 gloo ranks as a user would
write it. Silent ones are now refused on every rank before anything changes (two strategies combined, a step inside
``no_sync()``) or said (a resumed run keeping the saved learning rate); the rest were already right and stay so.

All cases run in one two-rank job (a module fixture); each test reads its case's outcome on both ranks."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.checkpoint import load_checkpoint, save_checkpoint
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import run_distributed
from testkit import regression_batch


def _net(seed: int, width: int = 8) -> nn.Module:
    """rel_testlib's tiny net without its dropout, so a run and its one-process reference match exactly."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(100 * step + rank, rows=4)


def _flat(values: Any) -> torch.Tensor:
    return torch.cat([v.detach().flatten() for v in values])


def _reference(steps: int, lr: float = 0.1, clip: float = 0.0, schedule: bool = False) -> torch.Tensor:
    """One process, the two ranks' batches averaged: what data parallelism must train."""
    net = _net(0)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if schedule else None
    for step in range(steps):
        opt.zero_grad()
        sum(F.mse_loss(net(x), y) for x, y in (_batch(r, step) for r in range(2))).div(2).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
    return _flat(net.parameters())


def _outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        return "ok", str(fn())
    except Exception as exc:  # the case's outcome, compared by the tests
        return type(exc).__name__, str(exc)


def _oss_under_fsdp(rank: int, tmp: Path) -> Any:
    model = FSDP(_net(0))
    before = _flat(model.parameters())
    try:
        OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    finally:
        assert torch.equal(_flat(model.parameters()), before)  # nothing changed


def _fsdp_inside_sdp(rank: int, tmp: Path) -> Any:
    inner = FSDP(_net(0))
    ShardedDataParallel(inner, OSS(inner.parameters(), optim=torch.optim.SGD, lr=0.1))


def _ddp_around_fsdp(rank: int, tmp: Path) -> Any:
    model = FSDP(_net(0))
    shard = _flat(model.parameters())
    try:
        nn.parallel.DistributedDataParallel(model)
    finally:
        assert torch.equal(_flat(model.parameters()), shard)  # rank 0's shard was not broadcast over rank 1's


def _ddp_around_nested_fsdp(rank: int, tmp: Path) -> Any:
    """DDP over a plain module holding an FSDP unit: DDP cannot see it at construction; the unit's first forward
    refuses, before any step."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(FSDP(nn.Linear(6, 8)), nn.Tanh(), nn.Linear(8, 3)))
    x, _ = _batch(rank, 0)
    model(x)


def _step_in_no_sync(wrapper: str) -> Callable[[int, Path], Any]:
    def case(rank: int, tmp: Path) -> Any:
        if wrapper == "fsdp":
            model: nn.Module = FSDP(_net(0))
            opt: Any = torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            net = _net(0)
            opt = OSS(net.parameters(), optim=torch.optim.SGD, lr=0.1)
            model = ShardedDataParallel(net, opt)
        x, y = _batch(rank, 0)
        before = _flat(model.state_dict().values())
        with model.no_sync():  # type: ignore[operator]
            F.mse_loss(model(x), y).backward()
            try:
                opt.step()  # one level too deep
            finally:
                assert torch.equal(_flat(model.state_dict().values()), before)
        return "stepped"

    return case


def _step_after_no_sync(rank: int, tmp: Path) -> Any:
    """The right accumulation still works: backward in the block, backward and step after it."""
    model = FSDP(_net(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(rank, 0)
    with model.no_sync():
        F.mse_loss(model(x[:2]), y[:2]).backward()
    F.mse_loss(model(x[2:]), y[2:]).backward()
    opt.step()
    return "stepped"


def _resume_with_new_lr(rank: int, tmp: Path) -> Any:
    model = nn.parallel.DistributedDataParallel(_net(0))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    directory = save_checkpoint(tmp / "lr", step=1, model=model, optimizer=opt)
    seen = {}
    for label, lr in (("same", 0.1), ("new", 0.001)):
        fresh = torch.optim.Adam(model.parameters(), lr=lr)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_checkpoint(directory, model=model, optimizer=fresh)
        seen[label] = ([str(w.message) for w in caught if "optimizer's settings" in str(w.message)], fresh)
    assert seen["same"][0] == []
    assert seen["new"][1].param_groups[0]["lr"] == 0.1  # the saved one: an exact resume
    return seen["new"][0][0]


def _resume_under_a_warmup_schedule(rank: int, tmp: Path) -> Any:
    """A scheduler built before loading moves ``lr`` itself (warm-up starts at 0): no warning for that."""
    model = nn.parallel.DistributedDataParallel(_net(0))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
    opt.step()
    sched.step()
    directory = save_checkpoint(tmp / "warmup", step=1, model=model, optimizer=opt)
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: min(1.0, (step + 1) / 10))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(directory, model=model, optimizer=fresh)
    return [str(w.message) for w in caught if "optimizer's settings" in str(w.message)]


def _fsdp_clip(rank: int, tmp: Path) -> Any:
    """torch's clip_grad_norm_ sees one rank's shard; FSDP's clip_grad_norm_ the global norm, as DDP clips."""
    results = {}
    for clip_with in ("torch", "fsdp"):
        model = FSDP(_net(0))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            x, y = _batch(rank, step)
            F.mse_loss(model(x), y).backward()
            if clip_with == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            else:
                model.clip_grad_norm_(0.05)
            opt.step()
        results[clip_with] = float((_flat(model.state_dict().values()) - _reference(2, clip=0.05)).abs().max())
    return results


def _changed_model(rank: int, tmp: Path) -> Any:
    model = FSDP(_net(0))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    directory = save_checkpoint(tmp / "model", step=1, model=model, optimizer=opt)
    wider = FSDP(_net(1, width=9))
    before = _flat(wider.state_dict().values())
    try:
        load_checkpoint(directory, model=wider, optimizer=torch.optim.Adam(wider.parameters(), lr=0.1))
    finally:
        assert torch.equal(_flat(wider.state_dict().values()), before)  # nothing loaded


def _changed_optimizer(rank: int, tmp: Path) -> Any:
    model = nn.parallel.DistributedDataParallel(_net(0))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    directory = save_checkpoint(tmp / "optimizer", step=1, model=model, optimizer=opt)
    load_checkpoint(directory, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _smp_partitions_beyond_world(rank: int, tmp: Path) -> Any:
    import shardkit.modelparallel as smp

    smp.init({"partitions": 4, "microbatches": 2})  # written for 4 processes, launched on 2


def _oss_with_scheduler(rank: int, tmp: Path) -> Any:
    model = nn.parallel.DistributedDataParallel(_net(0))
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for step in range(3):
        opt.zero_grad()
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    return float((_flat(model.module.parameters()) - _reference(3, schedule=True)).abs().max())


CASES: dict[str, Callable[[int, Path], Any]] = {
    "oss_under_fsdp": _oss_under_fsdp,
    "fsdp_inside_sdp": _fsdp_inside_sdp,
    "ddp_around_fsdp": _ddp_around_fsdp,
    "ddp_around_nested_fsdp": _ddp_around_nested_fsdp,
    "step_in_fsdp_no_sync": _step_in_no_sync("fsdp"),
    "step_in_sdp_no_sync": _step_in_no_sync("sdp"),
    "step_after_no_sync": _step_after_no_sync,
    "resume_with_new_lr": _resume_with_new_lr,
    "resume_under_warmup": _resume_under_a_warmup_schedule,
    "fsdp_clip": _fsdp_clip,
    "changed_model": _changed_model,
    "changed_optimizer": _changed_optimizer,
    "smp_partitions": _smp_partitions_beyond_world,
    "oss_with_scheduler": _oss_with_scheduler,
}


def _all_cases(rank: int, world_size: int, tmp: str) -> dict[str, tuple[str, str]]:
    outcomes = {}
    for name, case in CASES.items():
        outcomes[name] = _outcome(lambda case=case: case(rank, Path(tmp)))
        dist.barrier()  # every case starts together, whatever the last one did
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, tuple[str, str]]]:
    return run_distributed(_all_cases, 2, str(tmp_path_factory.mktemp("round2")))


def _both(outcomes: list[dict[str, tuple[str, str]]], name: str) -> list[tuple[str, str]]:
    return [ranks[name] for ranks in outcomes]


@pytest.mark.parametrize("name", ["oss_under_fsdp", "fsdp_inside_sdp"])
def test_oss_over_fsdp_shards_is_refused(outcomes: Any, name: str) -> None:
    for kind, message in _both(outcomes, name):
        assert kind == "ValueError" and "FullyShardedDataParallel's flat shards" in message, message
        assert "Use one strategy" in message


@pytest.mark.parametrize("name", ["ddp_around_fsdp", "ddp_around_nested_fsdp"])
def test_ddp_around_fsdp_is_refused_before_training(outcomes: Any, name: str) -> None:
    for kind, message in _both(outcomes, name):
        assert kind == "ValueError", message
        assert "DistributedDataParallel was given a model with FullyShardedDataParallel in it" in message


@pytest.mark.parametrize(("name", "wrapper"), [("step_in_fsdp_no_sync", "FullyShardedDataParallel"),
                                               ("step_in_sdp_no_sync", "ShardedDataParallel")])  # fmt: skip
def test_a_step_inside_no_sync_is_refused(outcomes: Any, name: str, wrapper: str) -> None:
    for kind, message in _both(outcomes, name):
        assert kind == "RuntimeError" and f"step() was called inside {wrapper}.no_sync()" in message, message
    assert _both(outcomes, "step_after_no_sync") == [("ok", "stepped")] * 2


def test_resuming_with_a_new_learning_rate_says_the_saved_one_is_kept(outcomes: Any) -> None:
    for kind, message in _both(outcomes, "resume_with_new_lr"):
        assert kind == "ok" and "param group 0: lr 0.001 -> 0.1" in message, message
    assert _both(outcomes, "resume_under_warmup") == [("ok", "[]")] * 2


def test_fsdp_clips_by_the_global_norm_where_torch_clips_a_shard(outcomes: Any) -> None:
    for kind, message in _both(outcomes, "fsdp_clip"):
        assert kind == "ok"
        errors = ast.literal_eval(message)  # {"torch": max diff, "fsdp": max diff} against the reference
        assert errors["fsdp"] < 1e-6 < errors["torch"]


def test_a_changed_model_or_optimizer_is_refused_at_load(outcomes: Any) -> None:
    for kind, message in _both(outcomes, "changed_model"):
        assert kind == "IncompatibleCheckpointError" and "does not fit this model" in message
        assert "Nothing was loaded" in message
    for kind, message in _both(outcomes, "changed_optimizer"):
        assert kind == "IncompatibleCheckpointError" and "load it into the optimizer class that saved it" in message


def test_a_config_written_for_another_world_size_is_refused(outcomes: Any) -> None:
    for kind, message in _both(outcomes, "smp_partitions"):
        assert kind == "ValueError" and "world size (2) to be a multiple of partitions (4)" in message


def test_oss_follows_an_lr_scheduler(outcomes: Any) -> None:
    for kind, message in _both(outcomes, "oss_with_scheduler"):
        assert kind == "ok" and float(message) == 0.0
