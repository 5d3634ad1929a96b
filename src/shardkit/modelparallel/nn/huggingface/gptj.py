"""Hugging Face GPT-J state dicts to and from smp's layout (``smdistributed.modelparallel.torch.nn.huggingface.gptj``).

The layout follows smp's GPT-2 one (:mod:`.gpt2`), for layer ``i``::

    Hugging Face (GPTJForCausalLM)               smp
    transformer.wte.weight                       word_embedding.weight
    transformer.h.i.ln_1.{weight,bias}           transformer.seq_layers.i.attention.pre_layernorm.*
    transformer.h.i.attn.{q,k,v}_proj.weight     transformer.seq_layers.i.attention.{query,key,value}.weight
    transformer.h.i.attn.out_proj.weight         transformer.seq_layers.i.attention.dense.weight
    transformer.h.i.mlp.fc_in.{weight,bias}      transformer.seq_layers.i.output.dense1.*
    transformer.h.i.mlp.fc_out.{weight,bias}     transformer.seq_layers.i.output.dense2.*
    transformer.ln_f.{weight,bias}               layernorm.*
    lm_head.{weight,bias}                        lm_head.* (GPT-J's head has a bias and is not tied)

GPT-J's one layer norm feeds both the attention and the feed-forward (they run side by side), so the output block
has no ``pre_layernorm``; its projections have no biases. GPT-J keeps no position table (rotary positions): the
causal-mask and rotary buffers older transformers versions saved are dropped going to smp and rebuilt by the model,
and ``max_seq_len`` is accepted for smp's signature and not needed. These weights do not load into
``smp.nn.DistributedTransformerLMHead``, whose blocks have neither rotary positions nor parallel attention: a GPT-J
is distributed by ``smp.tensor_parallelism()`` as a Hugging Face model (its own names) instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from shardkit.modelparallel.nn.huggingface.layout import Layout

__all__ = [
    "translate_hf_gptj_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gptj",
    "translate_state_dict_to_hf_gptj",
]

LAYOUT = Layout(
    family="GPT-J",
    hf_layers="transformer.h",
    smp_layers="transformer.seq_layers",
    block={
        "ln_1": "attention.pre_layernorm",
        "attn.q_proj": "attention.query",
        "attn.k_proj": "attention.key",
        "attn.v_proj": "attention.value",
        "attn.out_proj": "attention.dense",
        "mlp.fc_in": "output.dense1",
        "mlp.fc_out": "output.dense2",
    },
    top={
        "transformer.wte.weight": "word_embedding.weight",
        "transformer.ln_f.weight": "layernorm.weight",
        "transformer.ln_f.bias": "layernorm.bias",
        "lm_head.weight": "lm_head.weight",
        "lm_head.bias": "lm_head.bias",
    },
    dropped=r"(^transformer\.h\.\d+\.attn\.(bias|masked_bias|embed_positions)|^transformer\.rotary_emb\..*)$",
)


def translate_hf_state_dict_to_smdistributed_gptj(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """A ``GPTJForCausalLM`` state dict under smp's keys (see the module docstring). Unknown keys raise ``KeyError``."""
    return LAYOUT.to_smp(state_dict)


#: The name AWS's GPT-J scripts import (older smp versions).
translate_hf_gptj_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gptj


def translate_state_dict_to_hf_gptj(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """An smp-layout GPT-J state dict under ``GPTJForCausalLM``'s keys. Unknown keys raise ``KeyError``."""
    return LAYOUT.to_hf(state_dict)
