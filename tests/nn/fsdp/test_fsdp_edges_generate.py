"""Entry points other than forward: Hugging Face ``generate()`` on a wrapped model equals the unwrapped model's."""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import register_fsdp_forward_method
from shardkit.testing import run_distributed

transformers = pytest.importorskip("transformers")

GREEDY: dict[str, Any] = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}


def _gpt2_pair(group: Optional[object]) -> tuple[nn.Module, FSDP]:
    """An unwrapped tiny GPT-2 with random weights, and a copy with each block and the whole model wrapped."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    plain = transformers.GPT2LMHeadModel(config).eval()
    inner = copy.deepcopy(plain)
    for i, block in enumerate(inner.transformer.h):
        inner.transformer.h[i] = FSDP(block, process_group=group)
    return plain, FSDP(inner, process_group=group)


def _prompt() -> torch.Tensor:
    return torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(1))


def test_generate_routed_or_registered_equals_the_unwrapped_model() -> None:
    plain, model = _gpt2_pair(DummyProcessGroup(rank=0, size=1))
    want = plain.generate(_prompt(), **GREEDY)
    assert torch.equal(model.generate(_prompt(), **GREEDY), want)  # transformers' generate: routed unregistered
    with pytest.raises(RuntimeError, match="register_forward_method"):
        model.module.module.generate(_prompt(), **GREEDY)  # the user's own module: below every wrapper
    model.register_forward_method("generate")
    assert torch.equal(model.generate(_prompt(), **GREEDY), want)
    assert all(unit.unsharded_bytes() == 0 for unit in model.modules() if isinstance(unit, FSDP))
    # Nothing was patched on the user's module; forward and training still work afterwards.
    assert "generate" not in vars(model.module) and "forward" not in vars(model.module)
    logits = model(_prompt()).logits
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_generate_inside_summon_full_params() -> None:
    plain, model = _gpt2_pair(DummyProcessGroup(rank=0, size=1))
    want = plain.generate(_prompt(), **GREEDY)
    with model.summon_full_params():
        assert torch.equal(model.generate(_prompt(), **GREEDY), want)  # not registered: the method itself runs
        register_fsdp_forward_method(model, "generate")
        assert torch.equal(model.generate(_prompt(), **GREEDY), want)
        with pytest.raises(RuntimeError, match="summon_full_params"):
            model(_prompt())  # a forward with gradients inside summon would lose them: still refused


def test_bad_method_names_are_refused() -> None:
    model = FSDP(nn.Linear(2, 2), process_group=DummyProcessGroup(rank=0, size=1))
    with pytest.raises(AttributeError, match="no method 'generate'"):
        model.register_forward_method("generate")
    with pytest.raises(ValueError, match="already runs"):
        model.register_forward_method("forward")
    with pytest.raises(ValueError, match="attribute of FullyShardedDataParallel"):
        model.register_forward_method("state_dict")
    with pytest.raises(TypeError, match="FullyShardedDataParallel instance"):
        register_fsdp_forward_method(nn.Linear(2, 2), "forward")


def _generate_on_two_ranks(rank: int, world_size: int) -> tuple[bool, bool]:
    plain, model = _gpt2_pair(None)
    want = plain.generate(_prompt(), **GREEDY)
    model.register_forward_method("generate")
    got = model.generate(_prompt(), **GREEDY)
    with model.summon_full_params():
        inside = model.generate(_prompt(), **GREEDY)
    return torch.equal(got, want), torch.equal(inside, want)


def test_generate_at_world_size_two() -> None:
    assert run_distributed(_generate_on_two_ranks, 2, timeout_s=120) == [(True, True), (True, True)]
