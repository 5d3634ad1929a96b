"""transformers models as a training script builds them: the head of the model's task, its inputs and its loss.

``AutoModelForCausalLM`` is right for GPT-2 or Llama and wrong for BERT (a ``BertLMHeadModel`` that warns it is not
a decoder) or T5. The head is chosen once per workload: the config's ``architectures`` entry when a local config
names one (what the checkpoint was trained as), else the task the model type is made for, in this order: a
sequence-to-sequence LM for encoder-decoders (T5, BART), a masked LM for encoders (BERT, RoBERTa), a causal LM,
an image classifier (ViT, DeiT).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: Tasks whose heads the planner builds, and the transformers auto-mapping of each.
TASKS = ("causal_lm", "masked_lm", "seq2seq_lm", "image_classification")
_MAPPINGS = {
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
#: Class-name endings of the heads, for a config's ``architectures`` entry.
_HEAD_SUFFIXES = {
    "ForCausalLM": "causal_lm",
    "LMHeadModel": "causal_lm",
    "ForMaskedLM": "masked_lm",
    "ForConditionalGeneration": "seq2seq_lm",
    "ForImageClassification": "image_classification",
}
#: Attention implementations a workload may ask for ("": transformers' default, SDPA where supported).
ATTENTION = ("", "eager", "sdpa")


def _mapping(task: str) -> Mapping[str, str]:
    from transformers.models.auto import modeling_auto

    names: Mapping[str, str] = getattr(modeling_auto, _MAPPINGS[task])
    return names


def _architecture(config: Any) -> tuple[str, str]:
    """``(task, class name)`` from the config's ``architectures`` entry, or ``("", "")`` if it names no head the
    planner knows."""
    for name in getattr(config, "architectures", None) or ():
        for suffix, task in _HEAD_SUFFIXES.items():
            if name.endswith(suffix):
                if task == "seq2seq_lm" and not getattr(config, "is_encoder_decoder", False):
                    continue  # e.g. a vision-language ...ForConditionalGeneration: not a planned task
                return task, name
    return "", ""


def task_of(config: Any) -> str:
    """The task a model of ``config`` is trained for (see the module docstring), or a clear error."""
    task, _ = _architecture(config)
    if task:
        return task
    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False) and model_type in _mapping("seq2seq_lm"):
        return "seq2seq_lm"
    if not getattr(config, "is_decoder", False) and model_type in _mapping("masked_lm"):
        return "masked_lm"
    for task in ("causal_lm", "image_classification"):
        if model_type in _mapping(task):
            return task
    raise ValueError(
        f"transformers model type {model_type!r} has no causal LM, masked LM, sequence-to-sequence LM or image "
        "classification head; plan it as a factory instead (shardkit plan mypkg.models:build --batch-shape B,S "
        "--loss mypkg.models:loss)"
    )


def build_hf(config: Any, task: str, attention: str = "") -> nn.Module:
    """The model of ``config`` with ``task``'s head, random weights, with ``attention`` (default: transformers')."""
    import transformers

    arch_task, arch = _architecture(config)
    name = arch if arch_task == task else _mapping(task).get(config.model_type)
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise ValueError(f"transformers has no {task} head for model type {config.model_type!r}")
    kwargs = {"attn_implementation": attention} if attention else {}
    model: nn.Module = cls._from_config(config, **kwargs)
    return model


def hf_batch(config: Any, task: str, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """One rank's inputs for ``task``: token ids (for sequence-to-sequence LMs, as the decoder's inputs too), or
    images of the config's size for classifiers (``seq_len`` does not apply: the patches are the sequence)."""
    gen = torch.Generator().manual_seed(0)
    if task == "image_classification":
        size = config.image_size
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": torch.randn(batch_size, channels, size, size, generator=gen)}
    tokens = torch.randint(0, int(config.vocab_size), (batch_size, seq_len), generator=gen)
    if task == "seq2seq_lm":
        return {"input_ids": tokens, "decoder_input_ids": tokens}
    return {"input_ids": tokens}


def hf_loss(task: str, output: Any, batch: Any) -> torch.Tensor:
    """The loss of a masked or sequence-to-sequence LM (cross-entropy of every position against the tokens; which
    positions a real run masks does not change the memory) or of a classifier (against class 0)."""
    logits = output if isinstance(output, torch.Tensor) else output.logits
    if task == "image_classification":
        return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))
    tokens = batch["input_ids"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))


__all__ = ["ATTENTION", "TASKS", "build_hf", "hf_batch", "hf_loss", "task_of"]
