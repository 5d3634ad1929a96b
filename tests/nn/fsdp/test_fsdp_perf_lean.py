"""Lean FSDP: CPU offload keeps shards, gradients and optimizer state in CPU memory with identical results; one
rank makes no copies; frozen parameters are freed as soon as their unit's backward is over."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_testlib import build_fsdp, run_parity
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.memory import Category, MemoryTracker
from shardkit.nn.fsdp import BackwardPrefetch, CPUOffload
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.testing import models as M
from shardkit.testing import run_distributed

ONE = DummyProcessGroup(rank=0, size=1)


def _units(model: nn.Module) -> list[FSDP]:
    return [m for m in model.modules() if isinstance(m, FSDP)]


def _offload(rank: int, world_size: int) -> None:
    plain = run_parity(rank, world_size, "lm", nested=True)
    kwargs: dict[str, Any] = {"backward_prefetch": BackwardPrefetch.BACKWARD_PRE, "forward_prefetch": True}
    offloaded = run_parity(rank, world_size, "lm", nested=True, cpu_offload=CPUOffload(offload_params=True), **kwargs)
    assert offloaded == plain
    model = build_fsdp("lm", rank, world_size, nested=True, move_params_to_cpu=True)
    assert all(u.cpu_offload == CPUOffload(offload_params=True) and u.move_params_to_cpu for u in _units(model))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = M.make_batch("lm", model.module, 2, seed=rank)
    M.loss_for("lm", model(x), y).backward()
    optim.step()
    for p in model.parameters():  # FP32 shards and their gradients stay in CPU memory; the step ran there
        assert p.device.type == "cpu" and p.dtype == torch.float32
        assert p.grad is not None and p.grad.device.type == "cpu"
        assert all(s.device.type == "cpu" for s in optim.state[p].values())
    assert all(u.unsharded_bytes() == 0 for u in _units(model))
    # Moving an offloaded model after wrapping is a clear error that leaves the model usable.
    model.to("meta")
    with pytest.raises(RuntimeError, match="offloads its parameters to CPU"):
        model(x)
    assert all(u.training_state.name == "IDLE" for u in _units(model))


def test_cpu_offload_keeps_state_on_cpu_and_matches() -> None:
    run_distributed(_offload, 2)


def _train(model: nn.Module, steps: int) -> list[torch.Tensor]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = M.make_batch("lm", model.module if isinstance(model, FSDP) else model, 2, seed=step)
        loss = M.loss_for("lm", model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def _lm(wrap: bool) -> nn.Module:
    torch.manual_seed(0)
    model = M.TransformerLM(M.LMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=3, seq_len=16))
    if not wrap:
        return model
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, process_group=ONE)
    return FSDP(model, process_group=ONE)


def test_one_rank_makes_no_copies_and_trains_bit_identically() -> None:
    tracked = {}
    for wrap in (False, True):
        with MemoryTracker() as tracker:
            model = _lm(wrap)
            tracker.watch(model)
            losses = _train(model, 1)
            tracker.reset_peak()
            losses += _train(model, 2)
            tracked[wrap] = (losses, tracker.peak.total, tracker.current[Category.PARAMETERS])
        if wrap:
            for unit in _units(model):
                for handle in unit._unit.group.handles:
                    assert handle.full is not None and handle.full.data_ptr() == handle.shard.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(tracked[False][0], tracked[True][0]))
    assert tracked[True][2] == tracked[False][2], "one-rank FSDP holds more parameter memory than the plain model"
    # A full copy would add at least the root's and one block's parameters to the peak; what remains is the
    # concatenation of a unit's gradients into its flat gradient.
    param_bytes = sum(p.numel() * 4 for p in _lm(False).parameters())
    assert tracked[True][1] - tracked[False][1] < param_bytes // 20, (tracked[True][1], tracked[False][1])


def test_one_rank_follows_a_replaced_shard_storage() -> None:
    plain, wrapped = _lm(False), _lm(True)
    _train(plain, 1)
    _train(wrapped, 1)
    for p in wrapped.parameters():
        p.data = p.data.clone()  # e.g. loading into .data: the alias must follow the new storage
    assert all(torch.equal(a, b) for a, b in zip(_train(plain, 2), _train(wrapped, 2)))


class _Frozen(nn.Module):
    """A frozen layer and, optionally, a trainable one beside it in the same unit (LoRA-style)."""

    def __init__(self, mixed: bool) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.extra = nn.Linear(8, 8) if mixed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.frozen(x)
        return y + self.extra(x) if self.extra is not None else y


@pytest.mark.parametrize("mixed", [False, True])
def test_frozen_parameters_are_freed_after_their_units_backward(mixed: bool) -> None:
    torch.manual_seed(0)
    first = FSDP(nn.Linear(4, 8), process_group=ONE)
    middle = FSDP(_Frozen(mixed), process_group=ONE)
    model = FSDP(nn.Sequential(first, middle, FSDP(nn.Linear(8, 2), process_group=ONE)), process_group=ONE)
    seen: list[int] = []

    def watch_grad(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        # Fires when backward reaches the first unit's output, i.e. once the middle unit's backward is over.
        out.register_hook(lambda grad: seen.append(middle.unsharded_bytes()))

    first.register_forward_hook(watch_grad)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        assert seen[-1] == 0, "frozen parameters stayed gathered after their unit's backward"
        assert all(u.unsharded_bytes() == 0 and u.training_state.name == "IDLE" for u in _units(model))
    assert first.flat_params[0].grad is not None
    assert all(p.grad is None for p in middle.flat_params if not p.requires_grad)
