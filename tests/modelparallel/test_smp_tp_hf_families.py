"""smp tensor parallelism splits Hugging Face GPT-J, GPT-Neo, BERT and RoBERTa built inside
``smp.model_creation(tensor_parallelism=True)`` automatically, as it does GPT-2 (issue 34): at tensor_parallel_degree 2
the split model's logits, one training step's loss and the logits after it equal the unsplit model's; a BERT's partial
checkpoints resume bit-identically and its full checkpoint loads into a plain BERT. What the split leaves whole, and
the models it cannot split, are listed once, on rank 0."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit.hf_models import hf_batch, tiny_hf

transformers = pytest.importorskip("transformers")

TP2 = {"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True}
FAMILIES = ("gptj", "gpt_neo", "bert", "roberta")


@smp.step
def _train_step(model: smp.DistributedModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(input_ids=ids, labels=ids)
    model.backward(out.loss)
    return out.loss, out.logits.detach()


def _family(family: str) -> dict[str, Any]:
    smp.init(TP2)
    try:
        reference = tiny_hf(family)
        with smp.model_creation(tensor_parallelism=True):
            net = tiny_hf(family)
        model = smp.DistributedModel(net)
        out: dict[str, Any] = {
            "split": sorted({type(m).__name__ for m in net.modules() if "Parallel" in type(m).__name__})
        }
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
        plain = torch.optim.SGD(reference.parameters(), lr=0.5)
        ids = hf_batch(0)
        for step in ("first", "second"):  # the second step's forward runs on the weights the first one updated
            optimizer.zero_grad()
            loss, logits = _train_step(model, ids)
            optimizer.step()
            plain.zero_grad()
            theirs = reference(input_ids=ids, labels=ids)
            theirs.loss.backward()
            plain.step()
            out[f"{step} loss"] = abs(loss.reduce_mean().item() - theirs.loss.item())
            out[f"{step} logits"] = (logits.concat() - theirs.logits.detach()).abs().max().item()
        return out
    finally:
        smp.reset()


def _families(rank: int, world_size: int) -> dict[str, Any]:
    return {family: _family(family) for family in FAMILIES}


def test_gptj_gpt_neo_bert_roberta_at_tp2_are_split_and_compute_what_the_unsplit_model_does() -> None:
    for result in run_distributed(_families, 2):
        for family in FAMILIES:
            got = result[family]
            assert "ColumnParallelLinear" in got["split"] and "RowParallelLinear" in got["split"], (family, got)
            assert got["first logits"] < 1e-5 and got["first loss"] < 1e-5, (family, got)
            assert got["second logits"] < 1e-4 and got["second loss"] < 1e-5, (family, got)


def _bert_model() -> tuple[smp.DistributedModel, smp.DistributedOptimizer]:
    smp.init(TP2)
    with smp.model_creation(tensor_parallelism=True):
        net = tiny_hf("bert")
    model = smp.DistributedModel(net)
    return model, smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))


def _steps(model: smp.DistributedModel, optimizer: smp.DistributedOptimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        losses.append(_train_step(model, hf_batch(step))[0].reduce_mean().item())
        optimizer.step()
    return losses


def _bert_checkpoints(rank: int, world_size: int, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, optimizer = _bert_model()
    try:
        _steps(model, optimizer, range(2))
        smp.save_checkpoint(path, "p", model=model, optimizer=optimizer)
        smp.save_checkpoint(path, "f", partial=False, model=model)
        out["continued"] = _steps(model, optimizer, range(2, 4))
    finally:
        smp.reset()
    model, optimizer = _bert_model()
    try:
        smp.resume_from_checkpoint(path, tag="p")
        out["resumed"] = _steps(model, optimizer, range(2, 4))
    finally:
        smp.reset()
    plain = tiny_hf("bert", seed=1)
    plain.load_state_dict(torch.load(os.path.join(path, "f"), weights_only=True))  # strict: every key, whole
    with torch.no_grad():
        out["plain_from_full"] = plain(input_ids=hf_batch(2), labels=hf_batch(2)).loss.item()
    return out


def test_bert_tp2_partial_checkpoints_resume_bit_identically_and_the_full_one_loads_into_plain_bert(
    tmp_path: Any,
) -> None:
    for result in run_distributed(_bert_checkpoints, 2, str(tmp_path)):
        assert result["resumed"] == result["continued"], result  # bit-identical
        assert abs(result["plain_from_full"] - result["continued"][0]) < 1e-5, result


def _logged_once(rank: int, world_size: int) -> list[str]:
    """The smp log while wrapping a GPT-2 whose 127-token vocabulary TP 2 cannot split and one with 3 heads."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardkit.modelparallel").addHandler(handler)
    for config in ({"vocab_size": 127}, {"n_head": 3, "n_embd": 48}):
        smp.init(TP2)
        try:
            with smp.model_creation(tensor_parallelism=True):
                net = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_positions=16, **config))
            smp.DistributedModel(net)
        finally:
            smp.reset()
    return [message for message in records if message.startswith("smp.tensor_parallelism")]  # not smp.init's notes


def test_what_tensor_parallelism_leaves_unsplit_is_listed_once_on_rank_0() -> None:
    rank0, rank1 = run_distributed(_logged_once, 2)
    assert rank1 == [], rank1
    assert len(rank0) == 2, rank0  # one message per wrapped model
    split, unsplit = rank0
    assert "Hugging Face model <model> split by its gpt2 plan, left whole: " in split, split
    assert "vocabulary transformer.wte/lm_head (2 does not divide the vocabulary (127))" in split, split
    assert "h.*.ln_1 (x2)" in split and "wpe" in split, split
    assert "marked module(s) left unsplit: <model> (" in unsplit and "3" in unsplit, unsplit
