"""Delayed initialisation of Hugging Face models: modules without ``reset_parameters()`` (GPT-2's ``Conv1D``) are
created through the model's ``_init_weights``, as HF's ``post_init`` initialises them; a tensor nothing
initialises is refused."""

from __future__ import annotations

import math

import pytest
import torch
from smp_testlib import tiny_gpt2_config
from torch import nn

import shardkit.modelparallel as smp
from shardkit.modelparallel.building.delayed_init import materialize

transformers = pytest.importorskip("transformers")

SEED = 7
LAYERS = 2  # tiny_gpt2_config's


def _config() -> object:
    return tiny_gpt2_config()


@smp.step
def _forward(model: smp.DistributedModel, tokens: torch.Tensor) -> torch.Tensor:
    # The attention mask's values decide HF's mask path: the meta-device trace of a delayed model must know them.
    return model(input_ids=tokens, attention_mask=torch.ones_like(tokens), labels=tokens)["loss"]


def test_gpt2_built_inside_the_context_is_initialised_as_hf_does(single: None) -> None:
    torch.manual_seed(SEED)
    with smp.delay_param_initialization():
        net = transformers.GPT2LMHeadModel(_config())
    model = smp.DistributedModel(net)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = _forward(model, tokens).reduce_mean()
    state = model.state_dict()
    assert not any(t.is_meta or t.isnan().any() for t in state.values())
    # HF's scheme: Conv1D weights N(0, 0.02), the residual projections scaled by 1/sqrt(2 * n_layer), norms 1.
    c_attn = state["transformer.h.0.attn.c_attn.weight"].std().item()
    c_proj = state["transformer.h.0.attn.c_proj.weight"].std().item()
    assert abs(c_attn - 0.02) < 0.003 and abs(c_proj - 0.02 / math.sqrt(2 * LAYERS)) < 0.002, (c_attn, c_proj)
    assert torch.equal(state["transformer.h.1.ln_2.weight"], torch.ones(32))
    assert torch.equal(state["transformer.h.1.mlp.c_fc.bias"], torch.zeros(128))
    # The values are those of the model built normally and initialised module by module under the same seeds.
    torch.manual_seed(SEED)
    reference = transformers.GPT2LMHeadModel(_config())
    materialize(reference, lambda name: True, torch.device("cpu"), SEED)
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    with torch.no_grad():
        assert (
            loss.item()
            == reference(input_ids=tokens, attention_mask=torch.ones_like(tokens), labels=tokens).loss.item()
        )


class _Gate(nn.Module):
    """A module with a parameter neither ``reset_parameters`` nor GPT-2's ``_init_weights`` initialises."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


class _Index(nn.Module):
    """An integer buffer its ``__init__`` computes and nothing recreates."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("order", torch.arange(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h


def test_a_tensor_nothing_initialises_is_refused(single: None) -> None:
    torch.manual_seed(SEED)
    with smp.delay_param_initialization():
        net = transformers.GPT2LMHeadModel(_config())
        net.transformer.gate = _Gate()
        net.transformer.index = _Index()
    model = smp.DistributedModel(net)
    with pytest.raises(ValueError, match=r"nothing initialised .*transformer\.gate \(_Gate\), transformer\.index"):
        _forward(model, torch.zeros(2, 8, dtype=torch.long))
