"""Hugging Face models split by ``parallelize_hf`` at TP 2 compute what the whole model computes.

Tiny configs built here (no downloads). One launched world runs every family: logits, two SGD steps and greedy
``generate()`` with the KV cache against an unsplit copy of the same model on the same rank.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit import tensor_parallel as tp
from shardkit.testing import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _gpt2(dropout: float = 0.0) -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1, eos_token_id=2,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _gptj() -> nn.Module:
    config = transformers.GPTJConfig(
        n_layer=2, n_embd=32, n_head=4, rotary_dim=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1,
        eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPTJForCausalLM(config)


def _gpt_neo() -> nn.Module:
    config = transformers.GPTNeoConfig(
        num_layers=2, hidden_size=32, num_heads=4, vocab_size=VOCAB, max_position_embeddings=64, window_size=4,
        attention_types=[[["global", "local"], 1]], bos_token_id=1, eos_token_id=2, resid_dropout=0.0,
        embed_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return transformers.GPTNeoForCausalLM(config)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _phi3() -> nn.Module:
    """transformers' plan for Phi-3 gathers the fused qkv output and splits o_proj's whole input."""
    config = transformers.Phi3Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return transformers.Phi3ForCausalLM(config)


def _qwen3() -> nn.Module:
    """Qwen3 normalises each head's q and k (q_norm, k_norm: whole on every rank, gradients summed over the ranks)."""
    config = transformers.Qwen3Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config)


def _bert_config(cls: Any) -> Any:
    return cls(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip


def _bert() -> nn.Module:
    return transformers.BertForMaskedLM(_bert_config(transformers.BertConfig))


def _roberta() -> nn.Module:
    return transformers.RobertaForMaskedLM(_bert_config(transformers.RobertaConfig))


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "gpt2": _gpt2,
    "gptj": _gptj,
    "gpt_neo": _gpt_neo,
    "llama": _llama,
    "phi3": _phi3,
    "qwen3": _qwen3,
    "bert": _bert,
    "roberta": _roberta,
}
CAUSAL = ("gpt2", "gptj", "gpt_neo", "llama", "phi3", "qwen3")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(11))
    return ids, ids.clone()


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _train(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> list[float]:
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _merged(split: nn.Module, whole: nn.Module) -> float:
    """The ranks' state dicts merged by the layers' shard specs against the whole model's (same keys, shapes)."""
    shards: list[Any] = [None, None]
    dist.all_gather_object(shards, {k: v.detach() for k, v in split.state_dict().items()})
    merged, expected = tp.merge_state_dicts(shards, tp.tp_sharding(split)), whole.state_dict()
    assert merged.keys() == expected.keys(), sorted(set(merged) ^ set(expected))
    return max(_err(merged[k], v) if merged[k].shape == v.shape else float("inf") for k, v in expected.items())


def _family(name: str, state: tp.ParallelState) -> dict[str, float]:
    torch.manual_seed(5)
    whole = FAMILIES[name]()
    split = tp.parallelize_hf(copy.deepcopy(whole), state)
    ids, labels = _batch()
    errors = {"logits": _err(_logits(split, ids), _logits(whole, ids)), "merged state dict": _merged(split, whole)}
    split_losses, whole_losses = _train(split, ids, labels), _train(whole, ids, labels)
    errors["losses"] = max(abs(a - b) for a, b in zip(split_losses, whole_losses))
    errors["logits after 2 steps"] = _err(_logits(split, ids), _logits(whole, ids))
    if name in CAUSAL:
        prompt = ids[:, :5]
        kwargs = {"max_new_tokens": 4, "do_sample": False, "use_cache": True, "pad_token_id": 0}
        with torch.no_grad():
            ours, theirs = split.generate(prompt, **kwargs), whole.generate(prompt, **kwargs)
        errors["generate tokens differ"] = float((ours != theirs).sum().item()) + abs(ours.numel() - theirs.numel())
    if name == "llama":  # a static cache sizes its layers from the first keys: this rank's heads
        with torch.no_grad():
            ours = split.generate(prompt, cache_implementation="static", **kwargs)
            theirs = whole.generate(prompt, cache_implementation="static", **kwargs)
        errors["static-cache generate tokens differ"] = float((ours != theirs).sum().item())
    return errors


def _families(rank: int, world_size: int) -> dict[str, Any]:
    state = tp.init_parallel_state(tensor=2)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("shardkit.tensor_parallel.hf")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out: dict[str, Any] = {name: _family(name, state) for name in FAMILIES}
    out["log"] = records
    out["dropout"] = _dropout(state)
    out["different weights"] = _different_weights(state)
    try:
        odd = transformers.GPT2Config(n_layer=1, n_embd=48, n_head=3, vocab_size=VOCAB)
        tp.parallelize_hf(transformers.GPT2LMHeadModel(odd), state)
        out["three heads"] = "accepted"
    except ValueError as exc:
        out["three heads"] = str(exc)
    return out


def _dropout(state: tp.ParallelState) -> list[float]:
    """GPT-2 with dropout 0.1, seeded by the model-parallel seed: the losses of two steps, twice from the same seed,
    then with HF's gradient checkpointing (the second loss depends on the first step's gradients)."""
    losses = []
    for checkpointing in (False, False, True):
        tp.model_parallel_manual_seed(3, state.tp_rank)
        model = tp.parallelize_hf(_gpt2(dropout=0.1), state)
        if checkpointing:
            model.gradient_checkpointing_enable()
        ids, labels = _batch()
        losses += _train(model, ids, labels)
    return losses


def _different_weights(state: tp.ParallelState) -> str:
    torch.manual_seed(100 + state.tp_rank)
    model = _gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        tp.parallelize_hf(model, state)
    except ValueError as exc:
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return f"{exc} unchanged={unchanged}"
    return "accepted"


def test_every_family_at_tp_2_equals_the_whole_model_in_logits_training_and_generate() -> None:
    ranks = run_distributed(_families, 2, timeout_s=240)
    for rank, out in enumerate(ranks):
        for name in FAMILIES:
            assert out[name] and max(out[name].values()) < 1e-5, (rank, name, out[name])
        dropout = out["dropout"]
        assert dropout[:2] == dropout[2:4] == dropout[4:], dropout  # deterministic, also when recomputed
        assert all(loss == loss and loss > 0 for loss in dropout)
        assert "hold different values of 'transformer.wte.weight'" in out["different weights"]
        assert out["different weights"].endswith("unchanged=True")
        assert "'transformer.h.*.attn': num_heads=3" in out["three heads"], out["three heads"]
        assert "degrees that divide every size the plan splits: [1, 3]" in out["three heads"]
    assert ranks[0]["dropout"] == ranks[1]["dropout"]  # replicated activations dropped alike on both TP ranks
    log = ranks[0]["log"]
    assert any("gpt2 plan" in line and "transformer.h.*.ln_1 (x2)" in line for line in log), log
    assert any("bert plan" in line and "'cls.predictions.bias' also holds" in line for line in log), log
    assert not ranks[1]["log"]


def test_a_degree_that_does_not_divide_names_the_modules_sizes_and_degrees_that_fit() -> None:
    with pytest.raises(ValueError) as info:
        tp.resolve_hf_plan(_gpt2(), 3)
    message = str(info.value)
    assert "cannot split this gpt2 model 3 ways" in message
    assert "'transformer.h.*.attn': num_heads=4" in message
    assert "'transformer.h.*.attn.c_attn': features per q/k/v=32" in message
    assert "degrees that divide every size the plan splits: [1, 2, 4]" in message
    with pytest.raises(ValueError, match=r"config.num_key_value_heads=2.*degrees .*: \[1, 2\]"):
        tp.resolve_hf_plan(_llama(), 4)


def test_the_vocabulary_pair_is_split_together_or_kept_whole() -> None:
    gpt2 = tp.resolve_hf_plan(_gpt2(), 2)
    assert gpt2.vocab.split and gpt2.vocab.tied and gpt2.vocab.split_modules == ("transformer.wte", "lm_head")
    odd = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=127))
    kept = tp.resolve_hf_plan(odd, 2)
    assert not kept.vocab.split and "does not divide the vocabulary (127)" in kept.vocab.reason
    assert "transformer.wte" in kept.describe_unsplit() and "lm_head" in kept.describe_unsplit()
    with pytest.raises(ValueError, match=r"'transformer.wte': num_embeddings=127"):
        tp.resolve_hf_plan(odd, 2, split_vocab=True)
    with pytest.raises(ValueError, match=r"split_vocab=True, but 'cls.predictions.bias' also holds"):
        tp.resolve_hf_plan(_bert(), 2, split_vocab=True)
    llama = tp.resolve_hf_plan(_llama(), 2)
    assert llama.vocab.split and not llama.vocab.tied
    # Gemma's embedding is an nn.Embedding subclass that scales its output: a plain split lookup would drop the scale.
    gemma = transformers.GemmaForCausalLM(
        transformers.GemmaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=64, vocab_size=VOCAB, head_dim=8)
    )  # fmt: skip
    kept = tp.resolve_hf_plan(gemma, 2)
    assert not kept.vocab.split and "ScaledWordEmbedding, not nn.Embedding" in kept.vocab.reason, kept.vocab.reason


def test_a_model_split_already_is_refused() -> None:
    model = _gpt2()
    model.transformer.h[1].attn.c_attn = tp.TensorParallelModule()
    with pytest.raises(ValueError, match=r"'transformer.h.1.attn.c_attn' is a tensor-parallel layer already"):
        tp.resolve_hf_plan(model, 2)


def test_a_family_without_a_plan_is_refused_naming_the_known_ones() -> None:
    config = transformers.T5Config(num_layers=1, d_model=32, num_heads=4, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"no tensor-parallel plan for Hugging Face model type 't5'.*gpt2"):
        tp.resolve_hf_plan(transformers.T5ForConditionalGeneration(config), 2)


class _Attention(nn.Module):
    """Dropout on this rank's heads, then on the replicated output (a stand-in for GPT-2's attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.resid_dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads = torch.nn.functional.dropout(x, 0.5, training=self.training)
        return heads, self.resid_dropout(x * 2)


def _region_run(tp_rank: int, checkpointed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    from shardkit.tensor_parallel.hf.dropout import SplitDropoutRegion

    module = _Attention()
    SplitDropoutRegion(module, tp_rank, ["resid_dropout"])
    torch.manual_seed(0)
    x = torch.ones(64, requires_grad=True)
    if checkpointed:
        heads, out = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)
    else:
        heads, out = module(x)
    (heads * torch.arange(64.0) + out).sum().backward()
    assert x.grad is not None
    return heads.detach(), out.detach(), x.grad, torch.get_rng_state()


def test_split_attention_dropout_differs_across_ranks_agrees_outside_and_survives_recomputation() -> None:
    heads0, out0, grad0, after0 = _region_run(0)
    heads1, out1, _, after1 = _region_run(1)
    assert not torch.equal(heads0, heads1)  # each rank's heads get their own mask
    assert torch.equal(out0, out1)  # the replicated output is dropped alike on every rank
    assert torch.equal(after0, after1)  # the default generator advanced alike
    again = _region_run(0, checkpointed=True)
    assert torch.equal(again[0], heads0) and torch.equal(again[2], grad0)  # recomputation drew the same masks
