"""smp tensor parallelism on Hugging Face models (issue 34): a GPT-2 built inside ``smp.model_creation(
tensor_parallelism=True)`` is split whole by the core's GPT-2 plan when ``smp.DistributedModel`` wraps it, and trains
at tensor_parallel_degree 2 equal to plain torch; what is not built yet is refused on every rank. Its checkpoints:
partial ones per (pp rank, tp rank) resume bit-identically, full ones hold the merged model a plain GPT-2 loads."""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

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


def _refusal(config: dict[str, Any], build: Callable[[], Any], first_layer: Callable[[Any], Any]) -> str:
    """The error ``smp.DistributedModel`` raises for the model ``build`` makes inside ``smp.model_creation(
    tensor_parallelism=True)`` under ``config`` (checking the model's ``first_layer`` was not split)."""
    smp.init({"tensor_parallel_degree": 2, "ddp": True, **config})
    try:
        with smp.model_creation(tensor_parallelism=True):
            net = build()
        smp.DistributedModel(net)
    except NotImplementedError as exc:
        assert "ParallelLinear" not in type(first_layer(net)).__name__  # nothing was changed
        return str(exc)
    finally:
        smp.reset()
    return "accepted"


def _qwen3() -> Any:
    """Qwen3's plan sums q_norm's and k_norm's gradients over the ranks, by hooks delayed initialisation would lose."""
    config = transformers.Qwen3Config(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        head_dim=8, vocab_size=64, max_position_embeddings=16, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config)


def _train_gpt2(rank: int, world_size: int) -> dict[str, Any]:
    refusal = _refusal({}, _gpt2, lambda net: net.transformer.h[0].attn.c_attn)
    delayed = {"prescaled_batch": True, "delayed_parameter_initialization": True}
    qwen3 = _refusal(delayed, _qwen3, lambda net: net.model.layers[0].self_attn.q_proj) if world_size == 2 else "-"
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
            mine = train(model, ids.chunk(smp.rdp_size())[smp.rdp_rank()]).reduce_mean().item()
            losses.append(sum(smp.allgather(mine, smp.RDP_GROUP)) / smp.rdp_size())
            optimizer.step()
            plain.zero_grad()
            ref_loss = reference(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            plain.step()
            theirs.append(ref_loss.item())
        return {"split": split, "losses": losses, "theirs": theirs, "refusal": refusal, "qwen3": qwen3}
    finally:
        smp.reset()


@pytest.mark.parametrize("world_size", [2, 4])
def test_gpt2_at_tp2_is_split_by_its_plan_and_trains_equal_to_plain_torch(world_size: int) -> None:
    # 4 processes: TP 2 x reduced data 2, each TP group on its half of the batch
    for result in run_distributed(_train_gpt2, world_size):
        assert result["split"] == "Conv1DColumnParallel", result
        assert "set 'prescaled_batch': True" in result["refusal"], result
        qwen3 = result["qwen3"]
        assert ("q_norm" in qwen3 and "delayed" in qwen3) if world_size == 2 else qwen3 == "-", result
        for mine, theirs in zip(result["losses"], result["theirs"]):
            assert abs(mine - theirs) < 1e-5, result


TP2 = {"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True}


def _smp_gpt2() -> tuple[smp.DistributedModel, smp.DistributedOptimizer]:
    smp.init(TP2)
    with smp.model_creation(tensor_parallelism=True):
        net = _gpt2()
    model = smp.DistributedModel(net)
    return model, smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))


@smp.step
def _step(model: smp.DistributedModel, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids)["loss"]
    model.backward(loss)
    return loss


def _steps(model: smp.DistributedModel, optimizer: smp.DistributedOptimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        losses.append(_step(model, _batch(step)).reduce_mean().item())
        optimizer.step()
    return losses


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(step))


def _checkpoints(rank: int, world_size: int, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, optimizer = _smp_gpt2()
    try:
        _steps(model, optimizer, range(2))
        smp.save_checkpoint(path, "p", model=model, optimizer=optimizer, user_content={"step": 2})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            smp.save_checkpoint(path, "f", partial=False, model=model, optimizer=optimizer)
        out["full_warning"] = [str(w.message) for w in caught]
        smp.save(model.local_state_dict(), os.path.join(path, "w"), partial=True)
        loaded = smp.load(os.path.join(path, "w"), partial=True)
        mine = model.local_state_dict()
        out["save_load_equal"] = all(torch.equal(loaded[k], v) for k, v in mine.items() if isinstance(v, torch.Tensor))
        out["continued"] = _steps(model, optimizer, range(2, 4))
    finally:
        smp.reset()
    out["files"] = sorted(os.listdir(os.path.join(path, "p_partial")))
    model, optimizer = _smp_gpt2()
    try:
        out["user_content"] = smp.resume_from_checkpoint(path, tag="p")
        out["resumed"] = _steps(model, optimizer, range(2, 4))
    finally:
        smp.reset()
    model, optimizer = _smp_gpt2()
    try:
        smp.resume_from_checkpoint(path, tag="f", partial=False, load_optimizer=False)
        out["from_full"] = _steps(model, optimizer, range(2, 3))[0]
    finally:
        smp.reset()
    plain = _gpt2()
    plain.load_state_dict(torch.load(os.path.join(path, "f"), weights_only=True))  # strict: every key, whole
    with torch.no_grad():
        out["plain_from_full"] = plain(input_ids=_batch(2), labels=_batch(2)).loss.item()
    return out


def test_gpt2_tp2_partial_checkpoints_resume_bit_identically_and_full_ones_load_into_plain_gpt2(tmp_path: Any) -> None:
    for result in run_distributed(_checkpoints, 2, str(tmp_path)):
        assert result["files"] == ["model_0_0.pt", "model_0_1.pt", "optimizer_0_0.pt", "optimizer_0_1.pt"] + [
            "user_content.pt"
        ], result
        assert result["user_content"] == {"step": 2}
        assert result["resumed"] == result["continued"], result  # bit-identical
        assert abs(result["from_full"] - result["plain_from_full"]) < 1e-5, result
        assert abs(result["from_full"] - result["continued"][0]) < 1e-5, result
        assert result["save_load_equal"], result
        assert any("without the optimizer state" in w for w in result["full_warning"]), result
