"""Hugging Face BERT state dicts to and from smp's layout (``smdistributed.modelparallel.torch.nn.huggingface.bert``).

smp distributes a BERT's encoder as ``smp.nn.DistributedTransformer`` (post-norm blocks: ``pre_layernorm=False``,
``post_layernorm=True``) and leaves the embeddings, the pooler and the heads to Hugging Face. Only the encoder's keys
change, for layer ``i`` (after any outer prefix, ``bert.`` in ``BertForMaskedLM``, kept)::

    Hugging Face                                       smp
    encoder.layer.i.attention.self.{query,key,value}.*  encoder.seq_layers.i.attention.{query,key,value}.*
    encoder.layer.i.attention.output.dense.*            encoder.seq_layers.i.attention.dense.*
    encoder.layer.i.attention.output.LayerNorm.*        encoder.seq_layers.i.attention.layernorm.*
    encoder.layer.i.intermediate.dense.*                encoder.seq_layers.i.output.dense1.*
    encoder.layer.i.output.dense.*                      encoder.seq_layers.i.output.dense2.*
    encoder.layer.i.output.LayerNorm.*                  encoder.seq_layers.i.output.layernorm.*

Every other key is kept as it is. ``max_seq_len`` is accepted for smp's signature (BERT rebuilds no mask buffers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from shardkit.modelparallel.nn.huggingface.layout import Layout

__all__ = ["translate_hf_state_dict_to_smdistributed_bert", "translate_state_dict_to_hf_bert"]

#: The encoder's correspondence, shared with RoBERTa (the same encoder).
ENCODER_BLOCK = {
    "attention.self.query": "attention.query",
    "attention.self.key": "attention.key",
    "attention.self.value": "attention.value",
    "attention.output.dense": "attention.dense",
    "attention.output.LayerNorm": "attention.layernorm",
    "intermediate.dense": "output.dense1",
    "output.dense": "output.dense2",
    "output.LayerNorm": "output.layernorm",
}

LAYOUT = Layout(
    family="BERT", hf_layers="encoder.layer", smp_layers="encoder.seq_layers", block=ENCODER_BLOCK, keep_others=True
)


def translate_hf_state_dict_to_smdistributed_bert(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """A BERT state dict (``BertModel`` or a model holding one) with its encoder under smp's keys. A key inside an
    encoder layer that the table does not know raises ``KeyError``."""
    return LAYOUT.to_smp(state_dict)


def translate_state_dict_to_hf_bert(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """An smp-layout BERT state dict with its encoder back under Hugging Face's keys."""
    return LAYOUT.to_hf(state_dict)
