"""Tied parameters are never split across units: auto_wrap keeps them together, FSDP refuses a split."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.distributed import DummyProcessGroup
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import ties
from shardkit.nn.wrap import auto_wrap, enable_wrap, wrap
from shardkit.nn.wrap.tie_safety import blocked_modules
from shardkit.testing import run_distributed
from shardkit.testing.models import Block, LMConfig, TransformerLM, lm_batch

ONE = DummyProcessGroup(rank=0, size=1)
SMALL = 1000  # below the embedding's 64 x 32 = 2048 parameters, so the size policy selects embedding and head


class Wrapper(nn.Module):
    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def _structure(model: nn.Module) -> list[tuple[str, int, list[tuple[str, int]]]]:
    """Every module with its identity and its parameters' identities: equal lists mean an unchanged model."""
    return [
        (name, id(m), [(k, id(p)) for k, p in m._parameters.items()])
        for name, m in model.named_modules(remove_duplicate=False)
    ]


def test_auto_wrap_keeps_a_tied_embedding_and_head_in_the_parent_unit() -> None:
    model = TransformerLM()
    with enable_wrap(wrapper_cls=Wrapper), pytest.warns(UserWarning, match=r"'embed' \(Embedding\).*'head'"):
        model = auto_wrap(model, min_num_params=SMALL)
    assert isinstance(model, Wrapper)  # the root takes what is left, the tied weight included
    lm = model.module
    assert type(lm.embed) is nn.Embedding and type(lm.head) is nn.Linear
    assert lm.head.weight is lm.embed.weight
    assert all(isinstance(b.fc1, Wrapper) and isinstance(b.qkv, Wrapper) for b in lm.blocks)


def test_a_module_shared_by_two_parents_is_wrapped_alone_but_its_parents_are_not() -> None:
    shared = nn.Linear(8, 8)
    left, right = nn.Sequential(shared, nn.Linear(8, 8)), nn.Sequential(shared, nn.Linear(8, 8))
    model = nn.Sequential(left, right)
    blocked = blocked_modules(model, lambda m: False)
    assert set(blocked) == {id(left), id(right)}
    with enable_wrap(wrapper_cls=Wrapper), pytest.warns(UserWarning, match="shared by"):
        out = auto_wrap(model, auto_wrap_policy=lambda m, recurse, n: recurse or m is not model)
    assert out is model and type(left) is nn.Sequential and type(right) is nn.Sequential
    assert isinstance(left[0], Wrapper) and left[0] is right[0]


def test_tie_inside_one_subtree_does_not_block_it() -> None:
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    inner[1].weight = inner[0].weight
    model = nn.Sequential(inner, nn.Linear(4, 4))
    blocked = blocked_modules(model, lambda m: False)
    assert set(blocked) == {id(inner[0]), id(inner[1])}  # the two users, not the Sequential around both
    with enable_wrap(wrapper_cls=Wrapper), pytest.warns(UserWarning):
        auto_wrap(model, auto_wrap_policy=lambda m, recurse, n: recurse or m is not model)
    assert isinstance(model[0], Wrapper) and type(model[0].module[0]) is nn.Linear


def test_failed_auto_wrap_restores_the_model() -> None:
    built: list[nn.Module] = []

    def flaky(module: nn.Module, **kwargs: Any) -> nn.Module:
        if len(built) == 3:
            raise RuntimeError("wrapper failed")
        built.append(module)
        return Wrapper(module)

    model = TransformerLM()
    before = _structure(model)
    with enable_wrap(wrapper_cls=flaky), pytest.raises(RuntimeError, match="wrapper failed"):
        auto_wrap(model, min_num_params=SMALL)
    assert len(built) == 3  # some children had been replaced before the failure
    assert _structure(model) == before


def test_fsdp_refuses_to_split_a_tie_and_changes_nothing() -> None:
    model = TransformerLM()
    model.embed = FSDP(model.embed, process_group=ONE)
    before = _structure(model)
    with pytest.raises(ValueError, match=r"'head\.weight' is tied .*Embedding.*'embed'.*Linear 'head'"):
        FSDP(model, process_group=ONE)
    with enable_wrap(wrapper_cls=FSDP, process_group=ONE), pytest.raises(ValueError, match="Embedding"):
        wrap(model.head)  # the other side alone: a sibling unit
    assert _structure(model) == before
    assert type(model.head) is nn.Linear and isinstance(model.head.weight, nn.Parameter)


def test_rewrapping_after_a_failed_auto_wrap_succeeds() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.count = nn.Parameter(torch.zeros(3000, dtype=torch.long), requires_grad=False)

    model = TransformerLM()
    model.extra = Bad()
    with enable_wrap(wrapper_cls=FSDP, process_group=ONE), pytest.raises(TypeError, match="floating-point"):
        auto_wrap(model, min_num_params=SMALL)  # the blocks' units are built, then Bad fails
    assert all(type(b) is Block for b in model.blocks)
    del model.extra
    wrapped = FSDP(model, process_group=ONE)  # the blocks' aborted units no longer claim their parameters
    x, _ = lm_batch(model.cfg, 2, seed=0)
    assert wrapped(x).shape == (2, model.cfg.seq_len, model.cfg.vocab_size)


def test_a_claim_ends_with_its_unit() -> None:
    model = TransformerLM()
    embed_weight = model.embed.weight
    unit = FSDP(model.embed, process_group=ONE)
    assert ties.claim_of(embed_weight) is not None
    ref = weakref.ref(unit)
    del unit
    gc.collect()
    assert ref() is None and ties.claim_of(embed_weight) is None


def _tied_lm_parity(rank: int, world_size: int) -> None:
    cfg = LMConfig()
    torch.manual_seed(0)
    ref = DDP(TransformerLM(cfg))
    torch.manual_seed(0)
    with enable_wrap(wrapper_cls=FSDP), pytest.warns(UserWarning, match="tied|also"):
        model = auto_wrap(TransformerLM(cfg), min_num_params=SMALL)
    assert isinstance(model, FSDP) and isinstance(model.module.blocks[0].fc1, FSDP)  # several units
    assert type(model.module.embed) is nn.Embedding and type(model.module.head) is nn.Linear
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(4):
        x, y = lm_batch(cfg, 2, seed=100 * step + rank)
        losses = []
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            loss = TransformerLM.loss_fn(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5, msg=f"step {step}")
    got = model.state_dict()
    for key, value in ref.module.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=1e-5, msg=key)
    assert dist.get_world_size() == 2


def test_auto_wrapped_tied_lm_trains_like_ddp_on_two_ranks() -> None:
    run_distributed(_tied_lm_parity, 2)
