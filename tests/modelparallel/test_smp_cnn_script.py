"""End to end, the way a SageMaker model-parallel script trains a small CNN: config from ``SM_HP_MP_PARAMETERS``,
``StepLR``, bf16 autocast, a train step returning a tensor and Python values, an evaluation step returning Python
values, metrics gathered with ``smp.allgather`` over ``smp.DP_GROUP``, partial and full ``smp.save``/``smp.load``
and resuming from both. Run as a 2-stage pipeline, as 1 partition + ddp on 2 ranks, and as 2 x 2 on 4 ranks; every
loss and every reported metric on every rank is checked against the same training in one process.

Written from smp's public documentation; no code of AWS's example is used.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed

MICROBATCHES = 4
BATCH = 8  # per replica
STEPS = 4  # the checkpoints are taken after step SAVE_AT and training resumes from them
SAVE_AT = 2
EVAL_BATCHES = 2
TOL = 1e-5


class Net(nn.Module):
    """Two convolutions, max pooling and two linear layers over 1 x 12 x 12 images, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = torch.flatten(F.max_pool2d(x, 2), 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _images(kind: str, step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(zlib.crc32(kind.encode()) % 1000 + 1000 * step + 100_000 * replica)
    return torch.randn(BATCH, 1, 12, 12, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


def _optimizer(params: Any) -> tuple[torch.optim.Optimizer, StepLR]:
    opt = torch.optim.SGD(params, lr=0.2, momentum=0.5)
    return opt, StepLR(opt, step_size=1, gamma=0.7)


def _forward(model: nn.Module, x: torch.Tensor, amp: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        return model(x)


# ---- the script, as a user writes it --------------------------------------------------------------------------


@smp.step
def train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor, amp: bool) -> Any:
    output = _forward(model, x, amp)
    loss = F.nll_loss(output, y)
    model.backward(loss)
    return loss, loss.item(), int(output.argmax(dim=1).eq(y).sum().item())


@smp.step
def eval_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> Any:
    output = model(x)
    return F.nll_loss(output, y, reduction="sum").item(), int(output.argmax(dim=1).eq(y).sum().item())


def _train(model: Any, opt: Any, sched: StepLR, steps: range, amp: bool) -> list[dict[str, Any]]:
    model.train()
    records = []
    for step in steps:
        x, y = _images("train", step, smp.dp_rank())
        opt.zero_grad()
        loss, loss_items, correct = train_step(model, x, y, amp)
        opt.step()
        sched.step()
        records.append(
            {
                "loss": loss.reduce_mean().item(),
                "mb_losses": [t.item() for t in loss.outputs],
                "mb_items": loss_items,
                "correct": correct,
                "lr": sched.get_last_lr()[0],
            }
        )
    return records


def _evaluate(model: Any) -> dict[str, Any]:
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for batch in range(EVAL_BATCHES):
            x, y = _images("test", batch, smp.dp_rank())
            loss_batch, correct_batch = eval_step(model, x, y)
            test_loss += sum(loss_batch)
            correct += sum(correct_batch)
    gathered = smp.allgather((test_loss, correct), smp.DP_GROUP)
    return {"loss": sum(g[0] for g in gathered), "correct": sum(g[1] for g in gathered)}


def _fresh(seed: int) -> tuple[Any, Any, StepLR]:
    smp.init()  # the config comes from SM_HP_MP_PARAMETERS
    model = smp.DistributedModel(_net(seed))
    opt, sched = _optimizer(model.parameters())
    return model, smp.DistributedOptimizer(opt), sched


def _script(rank: int, world_size: int, directory: str, amp: bool) -> dict[str, Any]:
    partial_path, full_path = os.path.join(directory, f"partial{amp}.pt"), os.path.join(directory, f"full{amp}.pt")
    model, opt, sched = _fresh(seed=0)
    out: dict[str, Any] = {"dp_rank": smp.dp_rank(), "train": _train(model, opt, sched, range(SAVE_AT), amp)}
    if smp.dp_rank() == 0:
        partial = {"model": model.local_state_dict(), "optimizer": opt.local_state_dict()}
        smp.save({**partial, "scheduler": sched.state_dict()}, partial_path, partial=True)
        full = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        smp.save({**full, "scheduler": sched.state_dict()}, full_path, partial=False)
    smp.barrier()
    out["train"] += _train(model, opt, sched, range(SAVE_AT, STEPS), amp)
    out["eval"] = _evaluate(model)
    smp.reset()
    for kind, path, partial in (("partial", partial_path, True), ("full", full_path, False)):
        model, opt, sched = _fresh(seed=1)  # other weights: only the checkpoint can make it match
        checkpoint = smp.load(path, partial=partial)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        sched.load_state_dict(checkpoint["scheduler"])
        out[f"resumed_{kind}"] = _train(model, opt, sched, range(SAVE_AT, STEPS), amp)
        out[f"eval_{kind}"] = _evaluate(model)
        smp.reset()
    plain = Net()
    plain.load_state_dict(torch.load(full_path, weights_only=True)["model"])
    out["full_file"] = {k: v.clone() for k, v in plain.state_dict().items()}
    return out


# ---- the same training in one process ---------------------------------------------------------------------------


def _reference(replicas: int, amp: bool) -> dict[str, Any]:
    model = _net(0)
    opt, sched = _optimizer(model.parameters())
    train, saved = [], None
    for step in range(STEPS):
        opt.zero_grad()
        total: Any = 0.0
        per_replica = []
        for replica in range(replicas):
            x, y = _images("train", step, replica)
            mb = []
            for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
                output = _forward(model, xm, amp)
                loss = F.nll_loss(output, ym)
                mb.append((loss, int(output.argmax(dim=1).eq(ym).sum().item())))
            total = total + sum(loss for loss, _ in mb) / MICROBATCHES
            per_replica.append(
                {
                    "mb_losses": [loss.item() for loss, _ in mb],
                    "correct": [c for _, c in mb],
                    # as StepOutput.reduce_mean computes it (in the losses' dtype: bf16 under autocast)
                    "mean": (torch.stack([loss.detach() for loss, _ in mb]).sum(dim=0) / MICROBATCHES).item(),
                }
            )
        (total / replicas).backward()
        opt.step()
        sched.step()
        for record in per_replica:
            record["lr"] = sched.get_last_lr()[0]
        train.append(per_replica)
        if step + 1 == SAVE_AT:
            saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for replica in range(replicas):
            for batch in range(EVAL_BATCHES):
                x, y = _images("test", batch, replica)
                for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
                    output = model(xm)
                    test_loss += F.nll_loss(output, ym, reduction="sum").item()
                    correct += int(output.argmax(dim=1).eq(ym).sum().item())
    return {"train": train, "saved": saved, "eval": {"loss": test_loss, "correct": correct}}


def _check_train(got: list[dict[str, Any]], want: list[list[dict[str, Any]]], replica: int, where: str) -> None:
    for step, (g, w) in zip(range(STEPS - len(got), STEPS), zip(got, want[STEPS - len(got) :])):
        w = w[replica]
        for name in ("mb_losses", "mb_items"):
            diff = max(abs(a - b) for a, b in zip(g[name], w["mb_losses"]))
            assert len(g[name]) == MICROBATCHES and diff <= TOL, (where, step, name, g[name], w["mb_losses"])
        assert abs(g["loss"] - w["mean"]) <= TOL, (where, step, g["loss"], w["mean"])
        assert g["correct"] == w["correct"], (where, step, g["correct"], w["correct"])
        assert abs(g["lr"] - w["lr"]) <= 1e-12, (where, step, g["lr"], w["lr"])


CASES = {
    "pipeline-2": (2, {"partitions": 2, "microbatches": MICROBATCHES, "pipeline": "interleaved", "ddp": True}),
    "ddp-2": (2, {"partitions": "1", "microbatches": str(MICROBATCHES), "ddp": "true"}),  # strings, as tuners pass
    "2x2": (4, {"partitions": 2, "microbatches": MICROBATCHES, "pipeline": "interleaved", "ddp": True}),
}


# bf16 autocast on every layout; fp32 on the pipeline (the script trains under autocast and evaluates without it)
RUNS = [("pipeline-2", True), ("ddp-2", True), ("2x2", True), ("pipeline-2", False)]


@pytest.mark.parametrize("case,amp", RUNS, ids=[f"{case}-{'bf16' if amp else 'fp32'}" for case, amp in RUNS])
def test_cnn_script_matches_one_process_on_every_rank(tmp_path: Any, case: str, amp: bool) -> None:
    world_size, config = CASES[case]
    env = [{"SM_HP_MP_PARAMETERS": json.dumps(config)} for _ in range(world_size)]
    replicas = world_size // int(config["partitions"])
    reference = _reference(replicas, amp)
    assert len({x for step in reference["train"] for r in step for x in r["mb_losses"]}) > MICROBATCHES
    for rank, out in enumerate(run_distributed(_script, world_size, str(tmp_path), amp, rank_env=env)):
        replica = out["dp_rank"]
        _check_train(out["train"], reference["train"], replica, f"rank {rank}")
        for kind in ("partial", "full"):
            _check_train(out[f"resumed_{kind}"], reference["train"], replica, f"rank {rank} resumed from {kind}")
        for key in ("eval", "eval_partial", "eval_full"):
            got, want = out[key], reference["eval"]
            assert abs(got["loss"] - want["loss"]) <= TOL * max(1.0, abs(want["loss"])), (rank, key, got, want)
            assert got["correct"] == want["correct"], (rank, key, got, want)
        saved = reference["saved"]
        assert max((out["full_file"][k] - saved[k]).abs().max().item() for k in saved) <= TOL, rank
