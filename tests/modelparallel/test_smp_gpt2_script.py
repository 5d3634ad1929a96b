"""AWS's GPT-2 example (``train_gpt_simple.py`` with its ``data_pipeline.py``), without tensor parallelism, as a new
user runs it after changing the import: the script's smp config, data on the first pipeline stage only (the other
stage gets a dataset of empty placeholder tensors of the same length), ``smp.model_creation`` with delayed
parameter initialisation, auto-partition, the FP16 optimizer's arguments and names, partial and
full checkpoints whose ``user_content`` holds a ``GPT2Config`` and a ``numpy.int64``, and resuming from each.
Every logged loss equals one plain-torch process training the same model; resumed runs equal the uninterrupted
one bitwise. Also: stages whose data really differs are still refused, on every rank."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import pytest
import torch
from smp_testlib import AWS_GPT2_CONFIG, tiny_gpt2_config

import shardkit.modelparallel as smp
from shardkit.modelparallel.building.delayed_init import materialize
from shardkit.testing import run_distributed

transformers = pytest.importorskip("transformers")

SEED = 11
STEPS = 4
SAVE_AT = 2
BATCH = 4
SEQ = 8
VOCAB = 64
CONFIG = {**AWS_GPT2_CONFIG, "pipeline_parallel_degree": 2}


def _model_config() -> Any:
    return tiny_gpt2_config(positions=SEQ)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(5))


class _DummyDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """What the script's data pipeline gives the stages after the first: empty tensors, the real length."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.Tensor(0), torch.Tensor(0)

    def __len__(self) -> int:
        return self.length


def _dataloader() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    if smp.pp_rank() == 0:
        tokens = _tokens()
        data = torch.utils.data.TensorDataset(tokens, torch.ones_like(tokens))
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, drop_last=True)
        smp.broadcast(len(loader), smp.PP_GROUP)
        return loader
    length = smp.recv_from(0, smp.RankType.PP_RANK)
    return torch.utils.data.DataLoader(_DummyDataset(length * BATCH), batch_size=BATCH, drop_last=True)


@smp.step
def _train_step(model: Any, optimizer: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, args: Any) -> Any:
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def _param_groups(module: torch.nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in module.named_parameters() if not n.endswith("bias") and ".ln_" not in n]
    no_decay = [p for n, p in module.named_parameters() if n.endswith("bias") or ".ln_" in n]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


def _build() -> tuple[Any, Any, Any, Any]:
    """The script's set-up: init, model_creation, DistributedModel, optimizer, scheduler."""
    torch.manual_seed(SEED)  # the script's set_seed(args.seed)
    smp.init(CONFIG)
    config = _model_config()
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.get_default_dtype(), fused_softmax=True):
        net = transformers.AutoModelForCausalLM.from_config(config)
    model = smp.DistributedModel(net, trace_device="gpu", backward_passes_per_step=1)
    optimizer = torch.optim.AdamW(_param_groups(model.module), lr=0.01, weight_decay=0.01)
    optimizer = smp.DistributedOptimizer(
        optimizer,
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    return model, optimizer, scheduler, config


def _train(
    model: Any, optimizer: Any, scheduler: Any, config: Any, start: int, folder: str, save: bool
) -> list[list[float]]:
    args = argparse.Namespace(grad_clip=1.0)
    num_params = np.prod([1, sum(p.numel() for p in model.module.parameters())])  # numpy.int64, as the script's
    logged, total_steps = [], start
    for batch_idx, (input_ids, attention_mask) in enumerate(_dataloader()):
        if batch_idx < start:
            continue
        optimizer.zero_grad(set_to_none=True)
        loss_mb = _train_step(model, optimizer, input_ids, attention_mask, args)
        loss_mb.reduce_mean()
        optimizer.clip_master_grads(args.grad_clip)
        optimizer.step()
        if not optimizer.overflow:
            scheduler.step()
        total_steps += 1
        logged.append([t.item() for t in loss_mb.outputs])
        if save and total_steps == SAVE_AT:
            user_content = {
                "cli_args": vars(args),
                "num_params": num_params,
                "total_steps": total_steps,
                "model_config": config,
                "start_batch_index": batch_idx + 1,
                "lr_scheduler": scheduler.state_dict(),
            }
            tag = f"total_steps{total_steps}"
            keep = {"model": model, "optimizer": optimizer, "user_content": user_content}
            smp.save_checkpoint(f"{folder}/ckpt", tag=tag, partial=True, num_kept_partial_checkpoints=2, **keep)
            smp.save_checkpoint(f"{folder}/model", tag="fullmodel.pt", partial=False, **keep)
    return logged


def _resumed(folder: str, partial: bool) -> tuple[list[list[float]], dict[str, Any]]:
    model, optimizer, scheduler, config = _build()
    path, tag = (f"{folder}/ckpt", None) if partial else (f"{folder}/model", "fullmodel.pt")
    user_content = smp.resume_from_checkpoint(path, tag=tag, partial=partial)
    scheduler.load_state_dict(user_content["lr_scheduler"])
    logged = _train(model, optimizer, scheduler, config, user_content["start_batch_index"], folder, save=False)
    seen = {
        "config_is_gpt2": type(user_content["model_config"]) is transformers.GPT2Config,
        "n_embd": user_content["model_config"].n_embd,
        "num_params": user_content["num_params"],
    }
    smp.reset()
    return logged, seen


def _script(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    model, optimizer, scheduler, config = _build()
    total = sum(p.numel() for p in model.module.parameters())  # before the partition: every shape (on meta)
    logged = _train(model, optimizer, scheduler, config, 0, folder, save=True)
    held = sum(p.numel() for p in model.local_parameters())
    smp.reset()
    partial, seen = _resumed(folder, partial=True)
    full, _ = _resumed(folder, partial=False)
    return {"logged": logged, "partial": partial, "full": full, "seen": seen, "held": held, "total": total}


def _reference() -> list[list[float]]:
    """One plain-torch process: the model initialised as delayed initialisation documents, the batch cut in
    two micro-batches, AdamW, gradient clipping, the same schedule."""
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(_model_config())
    materialize(model, lambda name: True, torch.device("cpu"), SEED)
    optimizer = torch.optim.AdamW(_param_groups(model), lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    logged = []
    for tokens in _tokens().chunk(STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses = [model(input_ids=t, attention_mask=torch.ones_like(t), labels=t).loss for t in tokens.chunk(2)]
        (sum(losses) / 2).backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        logged.append([loss.item() for loss in losses])
    return logged


def test_gpt2_script_trains_and_resumes_equal_to_plain_torch(tmp_path: Any) -> None:
    reference = _reference()
    for rank, r in enumerate(run_distributed(_script, 2, str(tmp_path))):
        assert len(r["logged"]) == STEPS and r["held"] < r["total"], (rank, r["held"], r["total"])
        diff = max(abs(a - b) for got, want in zip(r["logged"], reference) for a, b in zip(got, want))
        assert diff <= 1e-6, (rank, diff, r["logged"], reference)
        assert r["partial"] == r["logged"][SAVE_AT:], (rank, r["partial"], r["logged"])
        assert r["full"] == r["logged"][SAVE_AT:], (rank, r["full"], r["logged"])
        assert r["seen"] == {"config_is_gpt2": True, "n_embd": 32, "num_params": r["total"]}, r["seen"]


def _differing(rank: int, world_size: int) -> str:
    torch.manual_seed(SEED)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))

    @smp.step
    def step(model: Any, x: torch.Tensor) -> Any:
        loss = model(x).sum()
        model.backward(loss)
        return loss

    x = torch.ones(4, 4) * (1 + rank)  # the second stage's data is not a placeholder and differs
    try:
        step(model, x)
    except ValueError as exc:
        return str(exc)
    finally:
        smp.reset()
    return "no error"


def test_stages_with_really_different_data_are_refused_on_every_rank() -> None:
    for message in run_distributed(_differing, 2):
        assert "the stages of one model replica got different inputs (stages [1] differ" in message, message
        assert "empty tensor" in message, message
