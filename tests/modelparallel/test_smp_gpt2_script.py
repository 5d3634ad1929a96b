"""AWS's GPT-2 example (``train_gpt_simple.py`` with its ``data_pipeline.py``) as a new user runs it after changing
the import, in each smp layout of :data:`LAYOUTS`: the script's smp config, data on the first pipeline stage only
(the other stage gets a dataset of empty placeholder tensors of the same length), ``smp.model_creation`` with delayed
parameter initialisation (and tensor parallelism where the layout has it), auto-partition, activation checkpointing
of every block, the FP16 optimizer's arguments and names, partial and full checkpoints whose ``user_content`` holds a
``GPT2Config`` and a ``numpy.int64``, and resuming from each. Every logged loss equals one plain-torch process
training the same model; resuming from a partial checkpoint equals the uninterrupted run bitwise, and from a full one
too where it holds the optimizer (under tensor parallelism smp's full checkpoint is the merged model only: the run
resumes with a new optimizer, as one process does). Also: stages whose data really differs are still refused, on
every rank."""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

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


@dataclass(frozen=True)
class Layout:
    """One configuration the script runs in: its smp settings over the script's defaults, the processes it takes,
    how close each logged loss must be to one plain-torch process, and whether its full checkpoint holds the
    optimizer state (smp's does not under tensor parallelism)."""

    config: dict[str, Any] = field(hash=False)
    world_size: int
    tol: float = 1e-6
    full_has_optimizer: bool = True

    @property
    def settings(self) -> dict[str, Any]:
        """The whole smp config: the script's defaults with this layout's settings."""
        return {**AWS_GPT2_CONFIG, **self.config}

    @property
    def prescaled_batch(self) -> bool:
        return bool(self.settings["prescaled_batch"])

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the script creates the model in (its --fp16 / --bf16)."""
        if self.settings["fp16"]:
            return torch.float16
        return torch.bfloat16 if self.settings["bf16"] else torch.get_default_dtype()

    @property
    def replicas(self) -> int:
        """How many batches each step trains on: one per reduced-data-parallel rank (prescaled_batch) or per
        data-parallel rank (the script's data pipeline shards by the same)."""
        tp = self.settings["tensor_parallel_degree"] if self.prescaled_batch else 1
        return self.world_size // (self.settings["pipeline_parallel_degree"] * tp)


#: The layouts the script is tested in (the smp settings it takes from its command line). Each further capability
#: is one more entry: its settings over the script's defaults, its world size, its loss tolerance against the
#: float32 reference, whether its full checkpoint holds the optimizer. For example sharded data parallelism,
#: ``Layout({"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2, "prescaled_batch": True}, 4)``, or
#: fp16, ``Layout({"pipeline_parallel_degree": 2, "fp16": True}, 2, tol=...)`` (the model is then created in
#: float16, as the script does, and trained with the script's dynamic loss scaler).
LAYOUTS = {
    "pp2": Layout({"pipeline_parallel_degree": 2}, 2),
    "tp2_x_pp2": Layout(
        {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "prescaled_batch": True},
        4,
        full_has_optimizer=False,
    ),
    # bf16, not fp16: the script's dynamic scale starts at 2**32, where FP16 gradients overflow for the first dozen
    # steps, so a 4-step run would skip them all. The reference is the bf16 model with FP32 masters by hand; it sums
    # the two micro-batches' gradients in bf16 where the shards sum them in FP32, and the row-split matmuls add their
    # partial sums in bf16 (measured: losses ~4.2 within 1.9e-3, 1.5e-4 at the first step, 1.3e-3 after the full
    # resume, where the reference with the old optimizer state instead of a new one is 0.12 away).
    "tp2_x_sdp2_bf16": Layout(
        {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "prescaled_batch": True, "bf16": True},
        4,
        tol=5e-3,
        full_has_optimizer=False,
    ),
}


def _model_config() -> Any:
    return tiny_gpt2_config(positions=SEQ)


def _tokens(replicas: int) -> torch.Tensor:
    """Every step's batch of every replica: ``(STEPS, replicas, BATCH, SEQ)``."""
    tokens = torch.randint(0, VOCAB, (STEPS * replicas * BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    return tokens.view(STEPS, replicas, BATCH, SEQ)


class _DummyDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """What the script's data pipeline gives the stages after the first: empty tensors, the real length."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.Tensor(0), torch.Tensor(0)

    def __len__(self) -> int:
        return self.length


def _dataloader(prescaled_batch: bool) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    if smp.pp_rank() == 0:  # the script's dp_rank / dp_size: the reduced ones with prescaled_batch
        rank, size = (smp.rdp_rank(), smp.rdp_size()) if prescaled_batch else (smp.dp_rank(), smp.dp_size())
        tokens = _tokens(size)[:, rank].reshape(-1, SEQ)
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


def _build(layout: Layout) -> tuple[Any, Any, Any, Any]:
    """The script's set-up: init, model_creation, DistributedModel, activation checkpointing, optimizer, scheduler."""
    torch.manual_seed(SEED)  # the script's set_seed(args.seed)
    smp.init(layout.settings)
    config = _model_config()
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=layout.dtype, fused_softmax=True):
        net = transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(SEED + smp.tp_rank())  # the script's seed per tensor-parallel rank (without --same_seed)
    model = smp.DistributedModel(net, trace_device="gpu", backward_passes_per_step=1)
    for block in model.get_module().transformer.h:  # the script's --activation_checkpointing, block by block
        smp.set_activation_checkpointing(block)
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
    model: Any, optimizer: Any, scheduler: Any, config: Any, start: int, folder: str, save: bool, prescaled: bool
) -> list[list[float]]:
    args = argparse.Namespace(grad_clip=1.0)
    num_params = np.prod([1, sum(p.numel() for p in model.module.parameters())])  # numpy.int64, as the script's
    logged, total_steps = [], start
    for batch_idx, (input_ids, attention_mask) in enumerate(_dataloader(prescaled)):
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


def _resumed(layout: Layout, folder: str, partial: bool) -> tuple[list[list[float]], dict[str, Any]]:
    model, optimizer, scheduler, config = _build(layout)
    path, tag = (f"{folder}/ckpt", None) if partial else (f"{folder}/model", "fullmodel.pt")
    with warnings.catch_warnings():  # a full checkpoint without the optimizer (tensor parallelism) says so
        warnings.simplefilter("ignore")
        user_content = smp.resume_from_checkpoint(path, tag=tag, partial=partial)
    scheduler.load_state_dict(user_content["lr_scheduler"])
    start = user_content["start_batch_index"]
    logged = _train(model, optimizer, scheduler, config, start, folder, False, layout.prescaled_batch)
    seen = {
        "config_is_gpt2": type(user_content["model_config"]) is transformers.GPT2Config,
        "n_embd": user_content["model_config"].n_embd,
        "num_params": user_content["num_params"],
    }
    smp.reset()
    return logged, seen


def _script(rank: int, world_size: int, layout: Layout, folder: str) -> dict[str, Any]:
    model, optimizer, scheduler, config = _build(layout)
    total = sum(p.numel() for p in model.module.parameters())  # before the partition: every shape (on meta)
    logged = _train(model, optimizer, scheduler, config, 0, folder, True, layout.prescaled_batch)
    held = sum(p.numel() for p in model.local_parameters())
    replica = smp.rdp_rank() if layout.prescaled_batch else smp.dp_rank()
    smp.reset()
    partial, seen = _resumed(layout, folder, partial=True)
    full, _ = _resumed(layout, folder, partial=False)
    return {
        "logged": logged,
        "partial": partial,
        "full": full,
        "seen": seen,
        "held": held,
        "total": total,
        "replica": replica,
    }


def _reference(
    replicas: int, new_optimizer_at: Optional[int] = None, dtype: torch.dtype = torch.float32
) -> list[list[list[float]]]:
    """One plain-torch process: the model initialised as delayed initialisation documents, each step's batch of
    every replica cut in two micro-batches, AdamW, gradient clipping, the same schedule. Every step's losses, per
    replica. ``new_optimizer_at``: from that step on with a new optimizer and the scheduler's state carried over (a
    resume from a checkpoint without the optimizer). ``dtype`` bfloat16: the model created in it, AdamW over FP32
    masters of its parameters (smp's bf16 optimizer, by hand)."""
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = transformers.AutoModelForCausalLM.from_config(_model_config())
    finally:
        torch.set_default_dtype(previous)
    materialize(model, lambda name: True, torch.device("cpu"), SEED)
    params = list(model.parameters())
    masters = {id(p): p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in params}

    def new_optimizer() -> torch.optim.Optimizer:
        groups = [{**g, "params": [masters[id(p)] for p in g["params"]]} for g in _param_groups(model)]
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.01)

    optimizer = new_optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    logged = []
    for step, tokens in enumerate(_tokens(replicas)):
        if step == new_optimizer_at:
            optimizer = new_optimizer()
            carried, scheduler = scheduler.state_dict(), torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
            scheduler.load_state_dict(carried)
        optimizer.zero_grad(set_to_none=True)
        for p in params:
            p.grad = None
        losses = [
            [model(input_ids=t, attention_mask=torch.ones_like(t), labels=t).loss.float() for t in share.chunk(2)]
            for share in tokens
        ]
        (sum(loss for share in losses for loss in share) / (2 * replicas)).backward()  # type: ignore[union-attr]
        for p in params:
            if masters[id(p)] is not p:
                masters[id(p)].grad = p.grad.float() if p.grad is not None else None
        torch.nn.utils.clip_grad_norm_(list(masters.values()), 1.0)
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            for p in params:
                if masters[id(p)] is not p:
                    p.copy_(masters[id(p)])
        logged.append([[loss.item() for loss in share] for share in losses])
    return logged


def _largest_difference(got: list[list[float]], want: list[list[list[float]]], replica: int) -> float:
    return max(abs(a - b) for mine, theirs in zip(got, want) for a, b in zip(mine, theirs[replica]))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_gpt2_script_trains_and_resumes_equal_to_plain_torch(name: str, tmp_path: Any) -> None:
    layout = LAYOUTS[name]
    reference = _reference(layout.replicas, dtype=layout.dtype)
    fresh = reference
    if not layout.full_has_optimizer:
        fresh = _reference(layout.replicas, new_optimizer_at=SAVE_AT, dtype=layout.dtype)
    for rank, r in enumerate(run_distributed(_script, layout.world_size, layout, str(tmp_path))):
        assert len(r["logged"]) == STEPS and r["held"] < r["total"], (rank, r["held"], r["total"])
        diff = _largest_difference(r["logged"], reference, r["replica"])
        assert diff <= layout.tol, (rank, diff, r["logged"], reference)
        assert r["partial"] == r["logged"][SAVE_AT:], (rank, r["partial"], r["logged"])
        if layout.full_has_optimizer:
            assert r["full"] == r["logged"][SAVE_AT:], (rank, r["full"], r["logged"])
        diff = _largest_difference(r["full"], fresh[SAVE_AT:], r["replica"])
        assert diff <= layout.tol, (rank, diff, r["full"], fresh[SAVE_AT:])
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
