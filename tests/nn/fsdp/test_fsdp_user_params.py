"""Parameters and call patterns users bring: LoRA (frozen + trainable in one unit), unused parameters, several
forwards before one backward, a module called twice, and evaluation under no_grad."""

from __future__ import annotations

from typing import Callable

import torch
from fsdp_testlib import assert_same_params, train_side_by_side
from torch import nn

from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import TrainingState
from shardkit.testing import run_distributed

Wrap = Callable[[nn.Module], nn.Module]


def _units(model: nn.Module) -> list[FSDP]:
    return [m for m in model.modules() if isinstance(m, FSDP)]


def _assert_all_idle_and_freed(model: nn.Module) -> None:
    for unit in _units(model):
        assert unit.training_state == TrainingState.IDLE
        assert unit.unsharded_bytes() == 0


# ---------------------------------------------------------------- LoRA: frozen and trainable in one unit
class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _lora_net(wrap: Wrap) -> nn.Module:
    frozen_head = nn.Linear(16, 4)
    frozen_head.requires_grad_(False)
    return nn.Sequential(LoRALinear(8, 16), nn.Tanh(), wrap(LoRALinear(16, 16)), nn.ReLU(), frozen_head)


def _regression_loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(4, 8)
    return (model(x) - 1.0).pow(2).mean()


def _lora(rank: int, world_size: int) -> None:
    for flatten in (True, False):
        ref, fsdp = train_side_by_side(rank, _lora_net, _regression_loss, flatten_parameters=flatten)
        assert_same_params(ref, fsdp, what=f"lora flatten={flatten}")
        for unit in _units(fsdp):
            for shard, meta in zip(unit.flat_params, unit.flat_param_metas):
                if not meta.requires_grad:
                    assert not shard.requires_grad and shard.grad is None, "a frozen shard got a gradient"
        torch.manual_seed(0)
        untouched = _lora_net(lambda m: m)
        with fsdp.summon_full_params(writeback=False):
            got = dict(fsdp.named_parameters())
            for name, p in untouched.named_parameters():
                if not p.requires_grad:
                    assert torch.equal(got[name], p), f"frozen parameter {name} changed"
                    assert not got[name].requires_grad
        _assert_all_idle_and_freed(fsdp)


def test_lora_frozen_and_trainable_in_one_unit() -> None:
    run_distributed(_lora, 2)


# ---------------------------------------------------------------- unused parameters
class Branchy(nn.Module):
    def __init__(self, wrap: Wrap) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.never_used = nn.Linear(8, 8)  # shares the root's flat parameter with used ones
        self.sometimes = wrap(nn.Linear(8, 8))  # a whole unit skipped on odd steps
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.sometimes(h) if self.step % 2 == 0 else h


def _branchy_loss(model: nn.Module, step: int) -> torch.Tensor:
    inner = model.module if isinstance(model, FSDP) else model
    inner.step = step
    return model(torch.randn(4, 8)).pow(2).mean()


def _unused(rank: int, world_size: int) -> list[float]:
    ref, fsdp = train_side_by_side(rank, Branchy, _branchy_loss, steps=2, momentum=0.0)
    assert_same_params(ref, fsdp, what="unused")
    # Step 1 (odd) skipped the `sometimes` unit: its shard keeps no gradient; the never-used layer inside the
    # root's flat parameter gets exact zeros, identically on every rank.
    sometimes = fsdp.module.sometimes
    assert all(p.grad is None for p in sometimes.flat_params)
    root_grad = fsdp.flat_params[0].grad
    assert root_grad is not None
    meta = fsdp.flat_param_metas[0]
    zeros = 0.0
    for piece in meta.shard_slices():
        info = meta.params[piece.param_index]
        if info.fqn.startswith("never_used"):
            length = piece.param_end - piece.param_start
            zeros += root_grad[piece.shard_start : piece.shard_start + length].abs().sum().item()
    assert zeros == 0.0
    _assert_all_idle_and_freed(fsdp)
    return [float(p.grad.abs().sum()) for p in fsdp.parameters() if p.grad is not None]


def test_unused_parameters_consistent_across_ranks() -> None:
    run_distributed(_unused, 2)


# ---------------------------------------------------------------- several forwards, a module called twice
class TwiceCalled(nn.Module):
    def __init__(self, wrap: Wrap) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = wrap(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
        self.out = wrap(nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.block(self.inp(x))))


def _two_forwards_loss(model: nn.Module, step: int) -> torch.Tensor:
    return model(torch.randn(4, 8)).pow(2).mean() + model(torch.randn(3, 8)).sin().mean()


def _call_patterns(rank: int, world_size: int) -> None:
    for reshard in (True, False):
        ref, fsdp = train_side_by_side(rank, TwiceCalled, _two_forwards_loss, reshard_after_forward=reshard)
        assert_same_params(ref, fsdp, what=f"two forwards, block twice, reshard={reshard}")
        _assert_all_idle_and_freed(fsdp)


def test_two_forwards_per_backward_and_module_called_twice() -> None:
    run_distributed(_call_patterns, 2)


# ---------------------------------------------------------------- eval under no_grad
def _eval(rank: int, world_size: int) -> None:
    ref, fsdp = train_side_by_side(rank, TwiceCalled, _two_forwards_loss, steps=1)
    grads_before = [p.grad.clone() for p in fsdp.parameters()]
    x = torch.randn(5, 8)
    for model in (ref, fsdp):
        model.eval()
    with torch.no_grad():
        out = fsdp(x)
        torch.testing.assert_close(out, ref(x), atol=1e-5, rtol=1e-5)
    assert not out.requires_grad
    _assert_all_idle_and_freed(fsdp)  # the root reshards too: no backward will come
    assert all(torch.equal(a, p.grad) for a, p in zip(grads_before, fsdp.parameters()))
    # A forward with grad enabled but never followed by backward must not break the next training step.
    fsdp.train()
    ref.train()
    fsdp(x)
    torch.manual_seed(7)
    loss = _two_forwards_loss(fsdp, 0)
    loss.backward()
    _assert_all_idle_and_freed(fsdp)


def test_eval_under_no_grad() -> None:
    run_distributed(_eval, 2)
