"""AWS's GPT-2 script with sharded data parallelism (``sharded_data_parallel_degree: 2`` on 2 processes, issue 34): the
script's config with the keys its GPT-NeoX sibling adds for it, ``smp.model_creation`` with delayed parameter
initialisation, HF GPT-2 (tied embedding and head), no ``clip_master_grads`` call (smp clips at ``optimizer.step()``
under sharded data parallelism, as AWS's scripts rely on), partial and full checkpoints holding a ``GPT2Config``, and
resuming from each. Every step's loss equals one plain-torch process; the partial resume equals the uninterrupted run
bitwise."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from smp_testlib import AWS_GPT2_CONFIG, tiny_gpt2_config
from test_smp_gpt2_script import SAVE_AT, SEED, STEPS, _param_groups, _reference, _schedule, _tokens

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed

transformers = pytest.importorskip("transformers")

CONFIG = {**AWS_GPT2_CONFIG, "sharded_data_parallel_degree": 2, "sdp_hierarchical_allgather": False}
CONFIG["sdp_gradient_clipping"] = 1.0  # the script's --grad_clip


@smp.step
def _train_step(model: Any, input_ids: torch.Tensor) -> Any:
    loss = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def _build() -> tuple[Any, Any, Any]:
    torch.manual_seed(SEED)
    smp.init(CONFIG)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.get_default_dtype()):
        net = transformers.AutoModelForCausalLM.from_config(tiny_gpt2_config(positions=8))
    model = smp.DistributedModel(net, trace_device="gpu")
    optimizer = smp.DistributedOptimizer(
        torch.optim.AdamW(_param_groups(model.module), lr=0.01, weight_decay=0.01),
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
    )
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)


def _train(model: Any, optimizer: Any, scheduler: Any, start: int, folder: str, save: bool) -> list[float]:
    """Each step's loss over the whole batch (every rank trains on its half of it)."""
    logged = []
    for step, tokens in enumerate(_tokens(1).flatten(0, 2).chunk(STEPS)):
        if step < start:
            continue
        optimizer.zero_grad(set_to_none=True)
        loss = _train_step(model, tokens.chunk(smp.dp_size())[smp.dp_rank()]).reduce_mean()
        optimizer.step()
        scheduler.step()
        losses = smp.allgather(loss.item(), smp.DP_GROUP)
        logged.append(sum(losses) / len(losses))
        if save and step + 1 == SAVE_AT:
            content = {"model_config": model.module.config, "num_params": np.int64(7), "start": step + 1}
            content["lr_scheduler"] = scheduler.state_dict()
            keep = {"model": model, "optimizer": optimizer, "user_content": content}
            smp.save_checkpoint(f"{folder}/ckpt", tag=f"total_steps{step + 1}", partial=True, **keep)
            with pytest.warns(UserWarning, match="without the optimizer state"):
                smp.save_checkpoint(f"{folder}/model", tag="fullmodel.pt", partial=False, **keep)
    return logged


def _script(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    model, optimizer, scheduler = _build()
    out: dict[str, Any] = {"logged": _train(model, optimizer, scheduler, 0, folder, save=True)}
    total = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(model.module.config).parameters())
    out["held"] = (sum(p.numel() for p in model.local_parameters()), total)
    out["units"] = len(model.sharded_module.fsdp_units())  # the root and each transformer block
    smp.reset()
    for partial in (True, False):
        model, optimizer, scheduler = _build()
        path, tag = (f"{folder}/ckpt", None) if partial else (f"{folder}/model", "fullmodel.pt")
        content = smp.resume_from_checkpoint(path, tag=tag, partial=partial, load_optimizer=partial)
        scheduler.load_state_dict(content["lr_scheduler"])
        assert type(content["model_config"]) is transformers.GPT2Config
        out[partial] = _train(model, optimizer, scheduler, content["start"], folder, save=False)
        smp.reset()
    return out


def test_gpt2_script_with_sharded_data_parallelism_equals_plain_torch(tmp_path: Any) -> None:
    reference = [sum(losses) / len(losses) for losses in (step[0] for step in _reference(1))]
    for rank, r in enumerate(run_distributed(_script, 2, str(tmp_path))):
        assert max(abs(a - b) for a, b in zip(r["logged"], reference)) <= 1e-6, (rank, r["logged"], reference)
        assert r[True] == r["logged"][SAVE_AT:], (rank, r[True], r["logged"])  # partial: bitwise
        # full: the weights, not the optimizer state (sharded; smp's full checkpoints hold the model only)
        assert abs(r[False][0] - r["logged"][SAVE_AT]) <= 1e-6, (rank, r[False], r["logged"])
        assert r["units"] == 3, r["units"]
        held, total = r["held"]
        assert held <= total // 2 + 64, r["held"]  # each rank holds half of every parameter (padding aside)
