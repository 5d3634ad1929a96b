"""``smp.nn.huggingface`` translations for GPT-J, GPT-Neo, BERT and RoBERTa (issue 34): a Hugging Face state dict
translated to smp's layout and back is the same state dict (keys and tensors), under smp's module names in between;
unknown keys raise. A translated state dict loads into smp's distributed modules and gives the Hugging Face model's
logits at tensor_parallel_degree 2: GPT-2 into ``smp.nn.DistributedTransformerLMHead``, BERT with its encoder
distributed as ``smp.nn.DistributedTransformer`` (``smp.tp_register_with_module``, as smp's page shows)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit.hf_models import hf_batch, tiny_hf

transformers = pytest.importorskip("transformers")
hf = smp.nn.huggingface

#: family -> (to smp, to Hugging Face, a key smp's layout has)
TRANSLATIONS: dict[str, tuple[Callable[..., Any], Callable[..., Any], str]] = {
    "gptj": (
        hf.gptj.translate_hf_gptj_state_dict_to_smdistributed,
        hf.gptj.translate_state_dict_to_hf_gptj,
        "transformer.seq_layers.1.output.dense2.bias",
    ),
    "gpt_neo": (
        hf.gptneo.translate_hf_state_dict_to_smdistributed_gptneo,
        hf.gptneo.translate_state_dict_to_hf_gptneo,
        "transformer.seq_layers.1.attention.query.weight",
    ),
    "bert": (
        hf.bert.translate_hf_state_dict_to_smdistributed_bert,
        hf.bert.translate_state_dict_to_hf_bert,
        "bert.encoder.seq_layers.1.attention.layernorm.weight",
    ),
    "roberta": (
        hf.roberta.translate_hf_state_dict_to_smdistributed_roberta,
        hf.roberta.translate_state_dict_to_hf_roberta,
        "roberta.encoder.seq_layers.1.output.dense1.weight",
    ),
}


@pytest.mark.parametrize("family", sorted(TRANSLATIONS))
def test_a_hf_state_dict_goes_to_smps_layout_and_back_unchanged(family: str) -> None:
    to_smp, to_hf, smp_key = TRANSLATIONS[family]
    source = tiny_hf(family).state_dict()
    smp_layout = to_smp(source, max_seq_len=8)
    assert smp_key in smp_layout, sorted(smp_layout)
    assert not any(".h." in key or "encoder.layer." in key for key in smp_layout), sorted(smp_layout)
    back = to_hf(smp_layout)
    assert back.keys() == source.keys(), sorted(set(back) ^ set(source))
    assert all(torch.equal(back[key], value) for key, value in source.items())
    target = tiny_hf(family, seed=1)
    target.load_state_dict(back)  # strict
    ids = hf_batch(0)
    with torch.no_grad():
        assert torch.equal(target(input_ids=ids).logits, tiny_hf(family)(input_ids=ids).logits)
    with pytest.raises(KeyError, match="not part of"):
        to_smp({**source, "transformer.h.0.attn.rotary.weight": torch.zeros(1), "encoder.layer.0.extra.weight": 0})
    with pytest.raises(KeyError, match="not part of"):
        to_hf({**smp_layout, smp_key.rsplit(".", 2)[0] + ".rotary.weight": torch.zeros(1)})  # in an smp layer


def test_the_names_awss_scripts_import_exist() -> None:
    assert (
        hf.gptj.translate_hf_state_dict_to_smdistributed_gptj is hf.gptj.translate_hf_gptj_state_dict_to_smdistributed
    )
    with pytest.raises(ValueError, match="exceeds"):
        hf.gptneo.translate_hf_state_dict_to_smdistributed_gptneo(tiny_hf("gpt_neo").state_dict(), max_seq_len=999)


TP2 = {"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True}


@smp.step
def _lm_logits(model: smp.DistributedModel, ids: torch.Tensor) -> torch.Tensor:
    return model((ids,))


def _gpt2_into_lm_head() -> float:
    source = tiny_hf("gpt2")
    config = source.config
    smp.init(TP2)
    try:
        lm = smp.nn.DistributedTransformerLMHead(
            num_layers=config.n_layer, num_attention_heads=config.n_head, attention_head_size=config.n_embd // 4,
            hidden_size=config.n_embd, intermediate_size=4 * config.n_embd, vocab_size=config.vocab_size,
            num_positions=config.n_positions, attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
            causal_mask_size=config.n_positions, pre_layernorm=True, post_layernorm=False,
        )  # fmt: skip
        model = smp.DistributedModel(lm)
        model.load_state_dict(hf.gpt2.translate_hf_state_dict_to_smdistributed_gpt2(source.state_dict()))
        ids = hf_batch(0)
        with torch.no_grad():
            return (_lm_logits(model, ids).concat() - source(input_ids=ids).logits).abs().max().item()
    finally:
        smp.reset()


def _encoder_args(config: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """smp's DistributedTransformer arguments for a BERT encoder (post-norm blocks)."""
    heads = config.num_attention_heads
    return (), {
        "num_layers": config.num_hidden_layers, "num_attention_heads": heads,
        "attention_head_size": config.hidden_size // heads, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "attention_dropout_prob": 0.0, "hidden_dropout_prob": 0.0,
        "layernorm_epsilon": config.layer_norm_eps, "pre_layernorm": False, "post_layernorm": True,
    }  # fmt: skip


def _encoder_inputs(hidden_states: torch.Tensor, attention_mask: Any = None, **_: Any) -> tuple[Any, dict[str, Any]]:
    if attention_mask is None:
        attention_mask = hidden_states.new_zeros(hidden_states.shape[0], 1, 1, hidden_states.shape[1])
    return ((hidden_states, attention_mask),), {}


def _encoder_output(out: tuple[torch.Tensor, torch.Tensor]) -> Any:
    return transformers.modeling_outputs.BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=out[0])


@smp.step
def _bert_logits(model: smp.DistributedModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask).logits


def _bert_with_distributed_encoder() -> dict[str, Any]:
    source = tiny_hf("bert")
    smp.init(TP2)
    try:
        encoder_cls = transformers.models.bert.modeling_bert.BertEncoder
        smp.tp_register_with_module(
            encoder_cls, smp.nn.DistributedTransformer, _encoder_args, _encoder_inputs, _encoder_output
        )
        net = tiny_hf("bert", seed=1)
        smp.set_tensor_parallelism(net.bert.encoder)
        model = smp.DistributedModel(net)
        kind = type(net.bert.encoder).__name__
        model.load_state_dict(hf.bert.translate_hf_state_dict_to_smdistributed_bert(source.state_dict()))
        ids, mask = hf_batch(1), torch.ones(4, 8, dtype=torch.long)
        mask[1, -3:] = 0
        with torch.no_grad():
            ours = _bert_logits(model, ids, mask).concat()
            return {
                "kind": kind,
                "error": (ours - source(input_ids=ids, attention_mask=mask).logits).abs().max().item(),
            }
    finally:
        smp.reset()


def _into_smp_modules(rank: int, world_size: int) -> dict[str, Any]:
    return {"gpt2": _gpt2_into_lm_head(), "bert": _bert_with_distributed_encoder()}


def test_translated_state_dicts_load_into_smps_distributed_modules_and_give_the_hf_logits_at_tp2() -> None:
    for result in run_distributed(_into_smp_modules, 2):
        assert result["gpt2"] < 1e-5, result
        assert result["bert"]["kind"] == "DistributedTransformer", result
        assert result["bert"]["error"] < 1e-5, result
