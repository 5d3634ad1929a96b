"""``smp.nn.huggingface.gpt2``: Hugging Face GPT-2 state dicts to smp's transformer layout and back."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from smp_testlib import tiny_gpt2_config
from transformers import GPT2LMHeadModel

from shardkit.modelparallel.nn.huggingface.gpt2 import (
    translate_hf_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gpt2,
    translate_state_dict_to_hf_gpt2,
)

EMBED = 32


def _gpt2(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config()).eval()


def test_the_import_path_of_smp_scripts_resolves() -> None:
    import shardkit.modelparallel as smp

    assert smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2 is translate_state_dict_to_hf_gpt2
    assert translate_hf_state_dict_to_smdistributed is translate_hf_state_dict_to_smdistributed_gpt2


def test_hf_to_smp_layout_splits_and_transposes() -> None:
    hf = _gpt2(0).state_dict()
    out = translate_hf_state_dict_to_smdistributed_gpt2(hf, max_seq_len=16)
    assert "lm_head.weight" not in out and not any(k.startswith("transformer.h.") for k in out)
    c_attn = hf["transformer.h.1.attn.c_attn.weight"]  # [in, 3 * out]
    assert torch.equal(out["transformer.seq_layers.1.attention.key.weight"], c_attn[:, EMBED : 2 * EMBED].t())
    bias = hf["transformer.h.1.attn.c_attn.bias"]
    assert torch.equal(out["transformer.seq_layers.1.attention.value.bias"], bias[2 * EMBED :])
    assert torch.equal(out["transformer.seq_layers.0.output.dense1.weight"], hf["transformer.h.0.mlp.c_fc.weight"].t())
    assert torch.equal(
        out["transformer.seq_layers.0.attention.pre_layernorm.weight"], hf["transformer.h.0.ln_1.weight"]
    )
    assert torch.equal(out["word_embedding.weight"], hf["transformer.wte.weight"])
    assert torch.equal(out["layernorm.bias"], hf["transformer.ln_f.bias"])
    # Each smp linear weight is [out, in], as torch.nn.Linear's.
    linear = torch.nn.functional.linear(torch.ones(1, EMBED), out["transformer.seq_layers.0.attention.dense.weight"])
    conv = torch.ones(1, EMBED) @ hf["transformer.h.0.attn.c_proj.weight"]
    assert torch.allclose(linear, conv, atol=1e-6)


def test_round_trip_gives_the_same_model() -> None:
    source = _gpt2(0)
    smp_layout = translate_hf_state_dict_to_smdistributed_gpt2(source.state_dict())
    back = translate_state_dict_to_hf_gpt2(smp_layout, max_seq_len=16)
    target = _gpt2(1)  # other values everywhere
    target.load_state_dict(back, strict=True)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(target(tokens).logits, source(tokens).logits)
    again = translate_hf_state_dict_to_smdistributed_gpt2(back)
    assert smp_layout.keys() == again.keys() and all(torch.equal(smp_layout[k], again[k]) for k in smp_layout)


def test_unknown_keys_and_a_too_long_sequence_are_refused() -> None:
    hf = _gpt2(0).state_dict()
    with pytest.raises(KeyError, match=r"transformer\.h\.0\.attn\.rotary"):
        translate_hf_state_dict_to_smdistributed_gpt2({**hf, "transformer.h.0.attn.rotary.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="exceeds the 16 positions"):
        translate_hf_state_dict_to_smdistributed_gpt2(hf, max_seq_len=17)
    smp_layout = translate_hf_state_dict_to_smdistributed_gpt2(hf)
    del smp_layout["transformer.seq_layers.0.attention.key.weight"]
    with pytest.raises(KeyError, match="only some of the three"):
        translate_state_dict_to_hf_gpt2(smp_layout)
