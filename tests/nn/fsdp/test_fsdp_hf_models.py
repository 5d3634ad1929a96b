"""Hugging Face models wrapped whole (one root unit) or block by block: ``generate()`` without registering,
``device``, ``dtype``, ``num_parameters()`` and ``get_input_embeddings()`` answer as the unwrapped model's.

Tiny GPT-2, Llama, T5 (encoder-decoder) and BERT (as a decoder) built from configs; greedy output compared
with the unwrapped model's, at world sizes 1 and 2.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.testing import run_distributed

transformers = pytest.importorskip("transformers")

GREEDY: dict[str, Any] = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
TOKENS = {"vocab_size": 100, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, **TOKENS)
    )


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        **TOKENS,
    )
    return transformers.LlamaForCausalLM(config)


def _t5() -> nn.Module:
    config = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, d_kv=8, num_heads=2, decoder_start_token_id=0, **TOKENS
    )
    return transformers.T5ForConditionalGeneration(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        max_position_embeddings=64,
        is_decoder=True,
        **TOKENS,
    )
    return transformers.BertLMHeadModel(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": _gpt2, "llama": _llama, "t5": _t5, "bert": _bert}


def _wrap(plain: nn.Module, group: Optional[Any], nested: bool) -> FSDP:
    """The whole model as one unit, or each block of every block list as a unit under a root unit."""
    model = copy.deepcopy(plain)
    if nested:
        for blocks in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
            for i, block in enumerate(blocks):
                blocks[i] = FSDP(block, process_group=group)
    return FSDP(model, process_group=group)


def _prompt() -> torch.Tensor:
    return torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))


def _check(name: str, nested: bool, group: Optional[Any]) -> list[str]:
    """What differs from the unwrapped model (empty when nothing does)."""
    torch.manual_seed(0)
    plain = MODELS[name]().eval()
    model = _wrap(plain, group, nested).eval()
    problems = []
    if model.device != plain.device or model.dtype != plain.dtype:
        problems.append(f"device/dtype {model.device}/{model.dtype}")
    for kwargs in ({}, {"only_trainable": True}, {"exclude_embeddings": True}):
        if model.num_parameters(**kwargs) != plain.num_parameters(**kwargs):
            problems.append(f"num_parameters({kwargs}) = {model.num_parameters(**kwargs)}")
    embeddings = model.get_input_embeddings()
    if not isinstance(embeddings, nn.Embedding) or embeddings.weight.shape != (100, 32):
        problems.append(f"get_input_embeddings() = {embeddings!r}")
    want = plain.generate(_prompt(), **GREEDY)
    if not torch.equal(model.generate(_prompt(), **GREEDY), want):  # not registered: routed for transformers
        problems.append("generate() differs")
    model.register_forward_method("generate")
    if not torch.equal(model.generate(_prompt(), **GREEDY), want):
        problems.append("registered generate() differs")
    if any(unit.unsharded_bytes() for unit in model.modules() if isinstance(unit, FSDP)):
        problems.append("full parameters left gathered")
    shards = {id(s) for unit in model.modules() if isinstance(unit, FSDP) for s in unit.flat_params}
    if {id(p) for p in model.parameters()} != shards:
        problems.append("model.parameters() no longer lists the flat shards only")
    return problems


@pytest.mark.parametrize("nested", [False, True], ids=["root_only", "nested"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_model_answers_as_unwrapped(name: str, nested: bool) -> None:
    assert _check(name, nested, DummyProcessGroup(rank=0, size=1)) == []


def _all_models_two_ranks(rank: int, world_size: int) -> dict[str, list[str]]:
    return {f"{name}-{nested}": _check(name, nested, None) for name in sorted(MODELS) for nested in (False, True)}


def test_hf_models_at_world_size_two() -> None:
    results = run_distributed(_all_models_two_ranks, 2, timeout_s=300)
    assert results[0] == results[1] == {f"{n}-{nested}": [] for n in sorted(MODELS) for nested in (False, True)}


def test_training_after_generate_still_steps_the_shards() -> None:
    torch.manual_seed(0)
    plain = _gpt2().eval()  # no dropout: the two runs must see the same computation
    model = _wrap(plain, DummyProcessGroup(rank=0, size=1), nested=False)
    model.generate(_prompt(), **GREEDY)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    for net, opt in ((plain, reference), (model, optim)):
        net(_prompt(), labels=_prompt()).loss.backward()
        opt.step()
    with model.summon_full_params():
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.allclose(got[n], p, atol=1e-6) for n, p in plain.named_parameters())


class Custom(nn.Module):
    """Not a transformers model: a method of its own that runs forward is not routed unless registered."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).argmax(-1)


def test_other_models_generate_raises_the_documented_error() -> None:
    model = FSDP(Custom(), process_group=DummyProcessGroup(rank=0, size=1))
    with pytest.raises(RuntimeError, match=r"register_forward_method\('generate'\)"):
        model.generate(torch.ones(1, 4))
    model.register_forward_method("generate")
    assert model.generate(torch.ones(1, 4)).shape == (1,)
