"""Consolidated OSS state dicts are plain torch.optim state dicts, loadable at any world size."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from oss_testlib import ddp_pair
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.optim import OSS
from shardkit.testing import run_distributed
from testkit import max_param_diff, same_optimizer_state, train_harness_model

NAME = "lm"


def _save_at(rank: int, world_size: int, folder: str) -> dict[str, float]:
    """Train 2 steps, save model and consolidated optimizer, then check three ways of continuing agree."""
    ref_model, oss_model, ref_opt, oss_opt = ddp_pair(NAME, "adamw")
    for model, opt in ((ref_model, ref_opt), (oss_model, oss_opt)):
        train_harness_model(NAME, model, opt, rank, range(2))
    oss_opt.consolidate_state_dict(recipient_rank=world_size - 1)
    out: dict[str, float] = {}
    if rank == world_size - 1:
        full = oss_opt.state_dict()
        out["equals_plain_state_dict"] = float(same_optimizer_state(full, ref_opt.state_dict()))
        torch.save({"model": oss_model.module.state_dict(), "optim": full}, Path(folder) / "ckpt.pt")
    else:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            oss_opt.state_dict()
    dist.barrier()
    ckpt = torch.load(Path(folder) / "ckpt.pt", weights_only=True)

    # A fresh OSS and a plain AdamW, both restored from the checkpoint, continue like the uninterrupted OSS.
    # Every continuing model gets a fresh DDP wrapper: DDP re-buckets gradients after its first step, and a
    # different bucket layout sums gradients in a different order (last-bit differences that AdamW amplifies).
    oss_model = DDP(oss_model.module)
    resumed_model = DDP(copy.deepcopy(oss_model.module))
    resumed_opt = OSS(resumed_model.parameters(), optim=torch.optim.AdamW, lr=123.0)
    resumed_opt.load_state_dict(ckpt["optim"])
    plain_model = DDP(copy.deepcopy(oss_model.module))
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=123.0)
    plain_opt.load_state_dict(copy.deepcopy(ckpt["optim"]))  # torch's load keeps the dict's tensors
    for model, opt in ((oss_model, oss_opt), (resumed_model, resumed_opt), (plain_model, plain_opt)):
        train_harness_model(NAME, model, opt, rank, range(2, 4))
    out["resumed_oss"] = max_param_diff(oss_model, resumed_model)
    out["resumed_plain"] = max_param_diff(oss_model, plain_model)
    return out


def _load_at(rank: int, world_size: int, folder: str) -> dict[str, float]:
    """Restore a checkpoint written at another world size into OSS and into a plain optimizer; train on."""
    ckpt = torch.load(Path(folder) / "ckpt.pt", weights_only=True)
    ref_model, oss_model, _, _ = ddp_pair(NAME, "adamw")
    for model in (ref_model, oss_model):
        model.module.load_state_dict(ckpt["model"])
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=123.0)
    oss_opt = OSS(oss_model.parameters(), optim=torch.optim.AdamW, lr=123.0)
    ref_opt.load_state_dict(copy.deepcopy(ckpt["optim"]))
    oss_opt.load_state_dict(ckpt["optim"])
    owned = {p for p, r in oss_opt.param_to_rank.items() if r == rank}
    only_owned = set(oss_opt.optim.state) == owned
    lr_loaded = oss_opt.param_groups[0]["lr"] == oss_opt.optim.param_groups[0]["lr"] == 1e-2
    for model, opt in ((ref_model, ref_opt), (oss_model, oss_opt)):
        train_harness_model(NAME, model, opt, rank, range(2, 5))
    return {"diff": max_param_diff(ref_model, oss_model), "only_owned": float(only_owned), "lr": float(lr_loaded)}


def test_save_at_4_load_at_2(tmp_path: Path) -> None:
    saved = run_distributed(_save_at, 4, str(tmp_path))
    assert saved[3]["equals_plain_state_dict"] == 1.0
    for result in saved:
        assert result["resumed_oss"] <= 1e-6
        assert result["resumed_plain"] <= 1e-6
    for result in run_distributed(_load_at, 2, str(tmp_path)):
        assert result == {"diff": pytest.approx(0.0, abs=1e-6), "only_owned": 1.0, "lr": 1.0}
