"""Hugging Face GPT-Neo state dicts to and from smp's layout
(``smdistributed.modelparallel.torch.nn.huggingface.gptneo``).

The layout follows smp's GPT-2 one (:mod:`.gpt2`), for layer ``i``::

    Hugging Face (GPTNeoForCausalLM)                      smp
    transformer.wte.weight                                word_embedding.weight (the LM head is tied to it)
    transformer.wpe.weight                                position_embedding.weight
    transformer.h.i.ln_1.{weight,bias}                    transformer.seq_layers.i.attention.pre_layernorm.*
    transformer.h.i.attn.attention.{q,k,v}_proj.weight    transformer.seq_layers.i.attention.{query,key,value}.weight
    transformer.h.i.attn.attention.out_proj.*             transformer.seq_layers.i.attention.dense.*
    transformer.h.i.ln_2.{weight,bias}                    transformer.seq_layers.i.output.pre_layernorm.*
    transformer.h.i.mlp.c_fc.{weight,bias}                transformer.seq_layers.i.output.dense1.*
    transformer.h.i.mlp.c_proj.{weight,bias}              transformer.seq_layers.i.output.dense2.*
    transformer.ln_f.{weight,bias}                        layernorm.*
    lm_head.weight                                        (none: tied to word_embedding.weight)

GPT-Neo's query, key and value have no biases. The attention-mask buffers (global and local windows) older
transformers versions saved are dropped going to smp and rebuilt by the model; ``max_seq_len`` is checked against the
position table and not otherwise needed. These weights do not load into ``smp.nn.DistributedTransformerLMHead``:
GPT-Neo does not scale its attention scores and alternates local attention windows, which smp's reference blocks do
not do; a GPT-Neo is distributed by ``smp.tensor_parallelism()`` as a Hugging Face model (its own names) instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from shardkit.modelparallel.nn.huggingface.layout import Layout, check_positions

__all__ = ["translate_hf_state_dict_to_smdistributed_gptneo", "translate_state_dict_to_hf_gptneo"]

LAYOUT = Layout(
    family="GPT-Neo",
    hf_layers="transformer.h",
    smp_layers="transformer.seq_layers",
    block={
        "ln_1": "attention.pre_layernorm",
        "attn.attention.q_proj": "attention.query",
        "attn.attention.k_proj": "attention.key",
        "attn.attention.v_proj": "attention.value",
        "attn.attention.out_proj": "attention.dense",
        "ln_2": "output.pre_layernorm",
        "mlp.c_fc": "output.dense1",
        "mlp.c_proj": "output.dense2",
    },
    top={
        "transformer.wte.weight": "word_embedding.weight",
        "transformer.wpe.weight": "position_embedding.weight",
        "transformer.ln_f.weight": "layernorm.weight",
        "transformer.ln_f.bias": "layernorm.bias",
    },
    tied={"lm_head.weight": "transformer.wte.weight"},
    dropped=r"^transformer\.h\.\d+\.attn\.attention\.(bias|masked_bias)$",
)


def translate_hf_state_dict_to_smdistributed_gptneo(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """A ``GPTNeoForCausalLM`` state dict under smp's keys (see the module docstring). Unknown keys raise
    ``KeyError``; a ``max_seq_len`` beyond the position table raises ``ValueError``."""
    check_positions(state_dict, "transformer.wpe.weight", max_seq_len)
    return LAYOUT.to_smp(state_dict)


def translate_state_dict_to_hf_gptneo(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """An smp-layout GPT-Neo state dict under ``GPTNeoForCausalLM``'s keys (``lm_head.weight`` is the word
    embedding). Unknown keys raise ``KeyError``."""
    check_positions(state_dict, "position_embedding.weight", max_seq_len)
    return LAYOUT.to_hf(state_dict)
