"""Sharded state dicts through torch.distributed.checkpoint: save at world size 4, resume at 2, train on.

Every run sees the same global batch per step (split evenly over the ranks), so training at any world size, and
an unwrapped model on the whole batch, follow the same trajectory; resuming must not change it.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import state_dict as fsdp_sd
from shardkit.testing import models as M
from shardkit.testing import run_distributed

GLOBAL_BATCH = 8
SAVE_AT, TOTAL = 2, 4


def build_lm(seed: int) -> FSDP:
    model = M.build("lm", seed=seed)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block)
    return FSDP(model)


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0, world_size: int = 1) -> None:
    cfg = M.LMConfig()
    per_rank = GLOBAL_BATCH // world_size
    for step in steps:
        x, y = M.lm_batch(cfg, GLOBAL_BATCH, seed=1000 + step)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        M.TransformerLM.loss_fn(model(x[rows]), y[rows]).backward()
        opt.step()


def as_numpy(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    # Tensors returned from a worker travel through shared-memory handles that die with the worker; arrays do not.
    return {k: v.numpy() for k, v in sd.items()}


def _save_then_continue(rank: int, world_size: int, path: str) -> Optional[dict[str, Any]]:
    model = build_lm(seed=0)
    opt = optimizer(model.parameters())
    train(model, opt, range(SAVE_AT), rank, world_size)
    sharded = fsdp_sd.sharded_state_dict(model)
    assert sharded["embed.weight"].to_local().shape[0] == 64 // world_size  # really sharded
    dcp.save(sharded, checkpoint_id=os.path.join(path, "model"))
    full_osd = model.gather_full_optim_state_dict(opt)
    if rank == 0:
        torch.save(full_osd, os.path.join(path, "optim.pt"))
    dist.barrier()
    train(model, opt, range(SAVE_AT, TOTAL), rank, world_size)  # the uninterrupted run
    sd = model.state_dict()  # a collective: every rank calls it
    return as_numpy(sd) if rank == 0 else None


def _resume(rank: int, world_size: int, path: str) -> Optional[dict[str, Any]]:
    model = build_lm(seed=1)  # different start: everything must come from the checkpoint
    opt = optimizer(model.parameters())
    target = fsdp_sd.sharded_state_dict(model)
    dcp.load(target, checkpoint_id=os.path.join(path, "model"))
    fsdp_sd.load_sharded_state_dict(model, target)
    full_osd = torch.load(os.path.join(path, "optim.pt"))
    opt.load_state_dict(model.get_shard_from_optim_state_dict(full_osd))
    train(model, opt, range(SAVE_AT, TOTAL), rank, world_size)
    sd = model.state_dict()  # a collective: every rank calls it
    return as_numpy(sd) if rank == 0 else None


def test_dcp_save_at_world_4_resume_at_world_2_trains_identically(tmp_path: Any) -> None:
    uninterrupted = {
        k: torch.from_numpy(v) for k, v in run_distributed(_save_then_continue, 4, str(tmp_path))[0].items()
    }
    resumed = {k: torch.from_numpy(v) for k, v in run_distributed(_resume, 2, str(tmp_path))[0].items()}
    assert list(resumed) == list(uninterrupted)
    for key, value in uninterrupted.items():
        torch.testing.assert_close(resumed[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")

    # The checkpoint is an ordinary DCP checkpoint of the unwrapped model: it loads without FSDP or processes,
    # holds what unsharded training reaches after SAVE_AT steps, and that model then trains on identically.
    ref = M.build("lm", seed=0)
    ref_opt = optimizer(ref.parameters())
    train(ref, ref_opt, range(SAVE_AT))
    plain = M.build("lm", seed=2)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "model"), no_dist=True)
    plain.load_state_dict(sd)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(sd[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    plain_opt = optimizer(plain.parameters())
    plain_opt.load_state_dict(torch.load(tmp_path / "optim.pt"))
    train(plain, plain_opt, range(SAVE_AT, TOTAL))
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(uninterrupted[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
