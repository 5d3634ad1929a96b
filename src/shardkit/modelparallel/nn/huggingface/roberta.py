"""Hugging Face RoBERTa state dicts to and from smp's layout
(``smdistributed.modelparallel.torch.nn.huggingface.roberta``): RoBERTa's encoder is BERT's, translated by the same
table (:mod:`.bert`); the outer prefix is ``roberta.`` in ``RobertaForMaskedLM``, and every key outside the encoder
layers (embeddings, pooler, ``lm_head``) is kept as it is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from shardkit.modelparallel.nn.huggingface.bert import ENCODER_BLOCK
from shardkit.modelparallel.nn.huggingface.layout import Layout

__all__ = ["translate_hf_state_dict_to_smdistributed_roberta", "translate_state_dict_to_hf_roberta"]

LAYOUT = Layout(
    family="RoBERTa", hf_layers="encoder.layer", smp_layers="encoder.seq_layers", block=ENCODER_BLOCK, keep_others=True
)


def translate_hf_state_dict_to_smdistributed_roberta(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """A RoBERTa state dict with its encoder under smp's keys (see :mod:`.bert` for the table)."""
    return LAYOUT.to_smp(state_dict)


def translate_state_dict_to_hf_roberta(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """An smp-layout RoBERTa state dict with its encoder back under Hugging Face's keys."""
    return LAYOUT.to_hf(state_dict)
