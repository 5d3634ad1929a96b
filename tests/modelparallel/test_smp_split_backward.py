"""Split backward (B: input gradients, W: weight gradients later) gives bit-identical gradients to the unsplit
backward, fires ``.grad`` hooks only in W, and refuses to split where a custom autograd.Function would run in
both halves; B releases the tensors only it needs (the schedules: test_smp_zb_schedules.py)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from shardkit.modelparallel.pipeline.saved_activations import SavedActivations
from shardkit.modelparallel.pipeline.split_backward import backward_input


class Tied(nn.Module):
    """A weight used twice on the stage, a frozen layer, BatchNorm, a glue parameter and a residual."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(6)
        self.scale = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        h = self.norm(self.frozen(h) * self.scale) + x
        return self.a(h), (self.scale * self.scale).sum() + h.mean()  # a's weight twice; a root w/o the input


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad * w * 2, (grad * x * 2).sum(0)


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = _Double.apply(x, self.w)
        return out, out.sum()


def _graph(build: Callable[[], nn.Module], repeats: int) -> tuple[nn.Module, list[Any]]:
    model = build()
    runs = []
    for k in range(repeats):
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(5, 6, generator=gen).requires_grad_(True)  # a received activation: a leaf
        out, aux = model(x)
        runs.append((x, [out, aux], [torch.randn(5, 6, generator=gen), torch.tensor(0.5)]))
    return model, runs


def _grads(model: nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None] + [x.grad for x in xs]


def test_split_backward_is_bit_identical_and_hooks_fire_in_w() -> None:
    ref, runs = _graph(Tied, 3)
    for _, tensors, grads in runs:
        torch.autograd.backward(tensors, grads)
    expected = _grads(ref, [x for x, _, _ in runs])

    model, runs = _graph(Tied, 3)
    fired: list[str] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _, name=name: fired.append(name))
    pending = []
    for x, tensors, grads in runs:  # every B first, then every W (as the schedule's cool-down does)
        result = backward_input(tensors, grads, [x])
        assert not isinstance(result, str), result
        (x.grad,), work = result
        pending.append(work)
    assert fired == [] and all(p.grad is None for p in model.parameters())
    for work in pending:
        work.run()
    got = _grads(model, [x for x, _, _ in runs])
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(fired) == trainable
    assert len(fired) == 3 * len(trainable)  # once per parameter per micro-batch
    assert model.frozen.weight.grad is None


class Mixer(nn.Module):
    """GELU's input and softmax's output are saved for B only; the linears' inputs also for W."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b, self.c = nn.Linear(6, 64), nn.Linear(64, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.c(torch.softmax(self.b(nn.functional.gelu(self.a(x))), -1))
        return out, out.sum() * 0.0


@pytest.mark.parametrize("build", [Mixer, Tied])
def test_b_frees_the_tensors_only_b_needs(build: Callable[[], nn.Module]) -> None:
    ref, runs = _graph(build, 2)
    for _, tensors, grads in runs:
        torch.autograd.backward(tensors, grads)
    expected = _grads(ref, [x for x, _, _ in runs])

    saved = SavedActivations()
    with saved.hooks():
        model, runs = _graph(build, 2)
    before_b = saved.total.live
    assert before_b > 0 and saved.total.peak == before_b == saved.saved.live
    pending = []
    for x, tensors, grads in runs:
        result = backward_input(tensors, grads, [x], saved)
        assert not isinstance(result, str), result
        (x.grad,), work = result
        pending.append(work)
    if build is Mixer:  # per micro-batch: GELU's 5x64 input is gone; W keeps the gradients of a, b and c's outputs
        floats = 4
        assert saved.saved.live == before_b - 2 * floats * 5 * 64
        assert saved.total.live == before_b + 2 * floats * (-5 * 64 + (5 * 64 + 5 * 6 + 5 * 6))
    for work in pending:
        work.run()
    got = _grads(model, [x for x, _, _ in runs])
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    del runs, pending, result, x, tensors, grads
    assert saved.total.live == 0  # the graphs are gone: every slot and held gradient was let go


def test_a_stage_without_input_gradients_does_everything_in_w() -> None:
    ref = Tied()
    x = torch.randn(5, 6)
    out, aux = ref(x)
    torch.autograd.backward([out, aux], [torch.ones(5, 6), torch.tensor(1.0)])
    model = Tied()
    out, aux = model(x)
    result = backward_input([out, aux], [torch.ones(5, 6), torch.tensor(1.0)], [])
    assert not isinstance(result, str)
    assert all(p.grad is None for p in model.parameters())
    result[1].run()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


def test_a_custom_function_on_both_paths_is_not_split() -> None:
    model = Custom()
    x = torch.randn(5, 6).requires_grad_(True)
    _, total = model(x)
    result = backward_input([total], [torch.tensor(1.0)], [x])
    assert isinstance(result, str) and "_DoubleBackward" in result
    assert model.w.grad is None and x.grad is None  # nothing computed: the caller runs it unsplit


def test_a_torch_compiled_module_is_not_split() -> None:
    """torch.compile's backward is one autograd.Function over the whole module: the stage runs unsplit."""
    model = torch.compile(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)), backend="aot_eager")
    x = torch.randn(5, 6).requires_grad_(True)
    result = backward_input([model(x).sum()], [torch.tensor(1.0)], [x])
    assert isinstance(result, str) and "CompiledFunctionBackward" in result


def test_a_user_checkpointed_block_splits_exactly_but_recomputes_in_w() -> None:
    """torch.utils.checkpoint inside a stage (not smp.set_activation_checkpointing, which runs unsplit): the
    gradients are still bit-identical; each W call that reaches the block recomputes it (documented cost)."""
    calls = [0]
    torch.manual_seed(0)
    a, b = nn.Linear(6, 6), nn.Linear(6, 6)

    def block(h: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return b(torch.tanh(a(h)))

    x0 = torch.randn(4, 6)
    x = x0.clone().requires_grad_(True)
    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
    expected = [a.weight.grad.clone(), b.weight.grad.clone(), x.grad.clone()]
    unsplit_calls, calls[0] = calls[0], 0
    a.zero_grad(), b.zero_grad()
    x = x0.clone().requires_grad_(True)
    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    result = backward_input([y.sum()], [torch.tensor(1.0)], [x])
    assert not isinstance(result, str)
    result[1].run()
    for got, want in zip([a.weight.grad, b.weight.grad, result[0][0]], expected):
        assert torch.equal(got, want)
    assert unsplit_calls == 2 and calls[0] > unsplit_calls
