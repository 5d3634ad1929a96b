"""smp tensor parallelism on Hugging Face models (issue 34): a GPT-2 built inside ``smp.model_creation(
tensor_parallelism=True)`` is split whole by the core's GPT-2 plan when ``smp.DistributedModel`` wraps it, and trains
at tensor_parallel_degree 2 equal to plain torch; what is not built yet is refused on every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed

transformers = pytest.importorskip("transformers")


def _gpt2() -> Any:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _refused_without_prescaled_batch() -> str:
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    try:
        with smp.model_creation(tensor_parallelism=True):
            net = _gpt2()
        smp.DistributedModel(net)
    except NotImplementedError as exc:
        assert type(net.transformer.h[0].attn.c_attn).__name__ == "Conv1D"  # nothing was changed
        return str(exc)
    finally:
        smp.reset()
    return "accepted"


def _train_gpt2(rank: int, world_size: int) -> dict[str, Any]:
    refusal = _refused_without_prescaled_batch()
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True})
    try:
        reference = _gpt2()
        with smp.model_creation(tensor_parallelism=True):
            net = _gpt2()
        model = smp.DistributedModel(net)
        split = type(net.transformer.h[0].attn.c_attn).__name__
        optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
        plain = torch.optim.Adam(reference.parameters(), lr=1e-2)

        @smp.step
        def train(model: smp.DistributedModel, ids: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=ids, labels=ids)["loss"]
            model.backward(loss)
            return loss

        losses, theirs = [], []
        for step in range(3):
            ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            losses.append(train(model, ids).reduce_mean().item())
            optimizer.step()
            plain.zero_grad()
            ref_loss = reference(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            plain.step()
            theirs.append(ref_loss.item())
        return {"split": split, "losses": losses, "theirs": theirs, "refusal": refusal}
    finally:
        smp.reset()


def test_gpt2_at_tp2_is_split_by_its_plan_and_trains_equal_to_plain_torch() -> None:
    for result in run_distributed(_train_gpt2, 2):
        assert result["split"] == "Conv1DColumnParallel", result
        assert "set 'prescaled_batch': True" in result["refusal"], result
        for mine, theirs in zip(result["losses"], result["theirs"]):
            assert abs(mine - theirs) < 1e-5, result
