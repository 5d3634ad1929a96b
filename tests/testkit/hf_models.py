"""Tiny Hugging Face models of the families smp v1 split automatically (GPT-2, GPT-J, GPT-Neo, BERT, RoBERTa):
two layers, hidden size 32, four heads, a 128-token vocabulary, no dropout, built from a seed (no downloads)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

VOCAB = 128
POSITIONS = 16


def _gpt2(transformers: Any) -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, activation_function="gelu",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _gptj(transformers: Any) -> nn.Module:
    config = transformers.GPTJConfig(
        n_layer=2, n_embd=32, n_head=4, rotary_dim=4, vocab_size=VOCAB, n_positions=POSITIONS, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPTJForCausalLM(config)


def _gpt_neo(transformers: Any) -> nn.Module:
    config = transformers.GPTNeoConfig(
        num_layers=2, hidden_size=32, num_heads=4, vocab_size=VOCAB, max_position_embeddings=POSITIONS, window_size=4,
        attention_types=[[["global", "local"], 1]], resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return transformers.GPTNeoForCausalLM(config)


def _bert_config(cls: Any) -> Any:
    return cls(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=POSITIONS + 2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )  # fmt: skip


def _bert(transformers: Any) -> nn.Module:
    return transformers.BertForMaskedLM(_bert_config(transformers.BertConfig))


def _roberta(transformers: Any) -> nn.Module:
    return transformers.RobertaForMaskedLM(_bert_config(transformers.RobertaConfig))


HF_FAMILIES: dict[str, Callable[[Any], nn.Module]] = {
    "gpt2": _gpt2,
    "gptj": _gptj,
    "gpt_neo": _gpt_neo,
    "bert": _bert,
    "roberta": _roberta,
}


def tiny_hf(family: str, seed: int = 0) -> nn.Module:
    """A tiny model of ``family`` (a key of :data:`HF_FAMILIES`) with its LM head, initialised from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    return HF_FAMILIES[family](transformers)


def hf_batch(step: int, rows: int = 4, length: int = 8) -> torch.Tensor:
    """Token ids (``rows`` x ``length``) for step ``step``, above the special ids."""
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(step))
