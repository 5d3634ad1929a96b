"""Hugging Face GPT-2 state dicts to and from smp's ``DistributedTransformerLMHead`` layout (unsplit).

smp replaces a GPT-2 model built inside ``smp.tensor_parallelism()`` by its ``smp.nn`` transformer, whose module
names follow the reference implementations on smp's tensor-parallelism page; these functions translate between
the two state dicts, as ``smdistributed.modelparallel.torch.nn.huggingface.gpt2`` does. Without tensor
parallelism every tensor is whole (one rank's shard is the full tensor). The layout, for layer ``i``::

    Hugging Face (GPT2LMHeadModel)               smp
    transformer.wte.weight                       word_embedding.weight (the LM head is tied to it)
    transformer.wpe.weight                       position_embedding.weight
    transformer.h.i.ln_1.{weight,bias}           transformer.seq_layers.i.attention.pre_layernorm.{weight,bias}
    transformer.h.i.attn.c_attn.{weight,bias}    transformer.seq_layers.i.attention.{query,key,value}.*
    transformer.h.i.attn.c_proj.{weight,bias}    transformer.seq_layers.i.attention.dense.*
    transformer.h.i.ln_2.{weight,bias}           transformer.seq_layers.i.output.pre_layernorm.*
    transformer.h.i.mlp.c_fc.{weight,bias}       transformer.seq_layers.i.output.dense1.*
    transformer.h.i.mlp.c_proj.{weight,bias}     transformer.seq_layers.i.output.dense2.*
    transformer.ln_f.{weight,bias}               layernorm.{weight,bias}
    lm_head.weight                               (none: tied to word_embedding.weight)

HF's ``Conv1D`` stores ``[in, out]`` weights and smp's linear layers ``[out, in]``, so weights are transposed;
``c_attn`` holds query, key and value side by side and is split in three (and joined back). The attention
masks older transformers keep as buffers (``attn.bias``, ``attn.masked_bias``) carry no weights: they are dropped
going to smp and rebuilt from ``max_seq_len`` going back when the installed transformers has them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from shardkit.modelparallel.nn.huggingface.layout import check_positions, refuse_unknown

__all__ = [
    "translate_hf_state_dict_to_smdistributed",
    "translate_hf_state_dict_to_smdistributed_gpt2",
    "translate_state_dict_to_hf_gpt2",
]

_LAYER = "transformer.seq_layers.{}."
#: HF suffix inside block ``i`` -> (smp suffix inside layer ``i``, transpose the weight).
_BLOCK = {
    "ln_1": ("attention.pre_layernorm", False),
    "attn.c_proj": ("attention.dense", True),
    "ln_2": ("output.pre_layernorm", False),
    "mlp.c_fc": ("output.dense1", True),
    "mlp.c_proj": ("output.dense2", True),
}
_TOP = {
    "transformer.wte.weight": "word_embedding.weight",
    "transformer.wpe.weight": "position_embedding.weight",
    "transformer.ln_f.weight": "layernorm.weight",
    "transformer.ln_f.bias": "layernorm.bias",
}
_HF_BLOCK_KEY = re.compile(r"^transformer\.h\.(\d+)\.(.+)\.(weight|bias)$")
_SMP_LAYER_KEY = re.compile(r"^transformer\.seq_layers\.(\d+)\.(.+)\.(weight|bias)$")
_MASK_BUFFERS = re.compile(r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$")


def translate_hf_state_dict_to_smdistributed_gpt2(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` (or ``GPT2Model``, keys without ``lm_head``) state dict in smp's layout.

    ``max_seq_len``, when given, must not exceed the position embedding's rows. Unknown keys raise ``KeyError``.
    """
    check_positions(state_dict, "transformer.wpe.weight", max_seq_len)
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in state_dict.items():
        if key in _TOP:
            out[_TOP[key]] = value
        elif key == "lm_head.weight" or _MASK_BUFFERS.match(key):
            continue  # tied to the word embedding / rebuilt from max_seq_len
        elif (match := _HF_BLOCK_KEY.match(key)) is not None:
            layer, module, kind = match.groups()
            prefix = _LAYER.format(layer)
            if module == "attn.c_attn":
                size = value.shape[-1] // 3
                for j, name in enumerate(("query", "key", "value")):
                    piece = value[..., j * size : (j + 1) * size]
                    out[f"{prefix}attention.{name}.{kind}"] = piece.t().contiguous() if kind == "weight" else piece
            elif module in _BLOCK:
                target, transpose = _BLOCK[module]
                out[f"{prefix}{target}.{kind}"] = value.t().contiguous() if transpose and kind == "weight" else value
            else:
                unknown.append(key)
        else:
            unknown.append(key)
    refuse_unknown(unknown, "Hugging Face GPT-2")
    return out


#: smp's generic name for the same translation (its HF guide imports this one from the gpt2 module).
translate_hf_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gpt2


def translate_state_dict_to_hf_gpt2(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """An smp-layout GPT-2 state dict as a ``GPT2LMHeadModel`` one (``lm_head.weight`` is the word embedding).

    With ``max_seq_len``, the causal-mask buffers of transformers versions that keep them are added, so that
    ``load_state_dict`` is strict-clean there. Unknown keys raise ``KeyError``.
    """
    check_positions(state_dict, "position_embedding.weight", max_seq_len)
    back = {smp: hf for hf, smp in _TOP.items()}
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, value in state_dict.items():
        if key in back:
            out[back[key]] = value
        elif (match := _SMP_LAYER_KEY.match(key)) is not None:
            layer, module, kind = match.groups()
            layers.setdefault(layer, {})[f"{module}.{kind}"] = value
        else:
            unknown.append(key)
    for layer, tensors in sorted(layers.items(), key=lambda item: int(item[0])):
        unknown += _block_to_hf(layer, tensors, out)
    refuse_unknown(unknown, "smp GPT-2")
    if "transformer.wte.weight" in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    if max_seq_len is not None and _hf_keeps_mask_buffers():
        mask = torch.tril(torch.ones(max_seq_len, max_seq_len, dtype=torch.bool)).view(1, 1, max_seq_len, max_seq_len)
        for layer in layers:
            out[f"transformer.h.{layer}.attn.bias"] = mask.clone()
            out[f"transformer.h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    return out


def _block_to_hf(layer: str, tensors: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> list[str]:
    """Put layer ``layer``'s tensors into ``out`` under HF names; returns the smp keys it did not know."""
    prefix = f"transformer.h.{layer}."
    for kind in ("weight", "bias"):
        parts = [tensors.pop(f"attention.{name}.{kind}", None) for name in ("query", "key", "value")]
        if all(p is not None for p in parts):
            pieces = [p.t() if kind == "weight" else p for p in parts if p is not None]
            out[f"{prefix}attn.c_attn.{kind}"] = torch.cat(pieces, dim=-1).contiguous()
        elif any(p is not None for p in parts):
            return [f"{_LAYER.format(layer)}attention.{{query,key,value}}.{kind} (only some of the three)"]
    for hf_module, (smp_module, transpose) in _BLOCK.items():
        for kind in ("weight", "bias"):
            value = tensors.pop(f"{smp_module}.{kind}", None)
            if value is not None:
                out[f"{prefix}{hf_module}.{kind}"] = value.t().contiguous() if transpose and kind == "weight" else value
    return [_LAYER.format(layer) + rest for rest in tensors]


def _hf_keeps_mask_buffers() -> bool:
    """Whether the installed transformers' GPT-2 attention keeps its causal mask as persistent buffers."""
    try:
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    except ImportError:
        return False
    build: Callable[..., Any] = GPT2Attention
    with torch.device("meta"):
        attention = build(GPT2Config(n_embd=8, n_head=2, n_positions=4, n_layer=1))
    return "bias" in attention.state_dict()
