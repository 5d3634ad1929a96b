"""is_checkpointing / is_recomputing / disable_checkpointing: what a module's forward sees, on any thread."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from shardkit.nn.checkpoint import checkpoint_activations as fairscale_path
from shardkit.nn.checkpoint import (
    checkpoint_wrapper,
    disable_checkpointing,
    enable_checkpointing,
    enable_recomputing,
    is_checkpointing,
    is_checkpointing_disabled,
    is_recomputing,
)


class Recorder(nn.Module):
    """Linear → tanh → Linear; records (is_checkpointing, is_recomputing, thread) at every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)
        self.seen: list[tuple[bool, bool, int]] = []
        self.side_effects = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((is_checkpointing(), is_recomputing(), threading.get_ident()))
        if not is_recomputing():
            self.side_effects += 1
        return self.fc2(torch.tanh(self.fc1(x)))


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_flags_default_false_and_contexts_nest() -> None:
    assert not (is_checkpointing() or is_recomputing() or is_checkpointing_disabled())
    with enable_checkpointing():
        assert is_checkpointing()
        with enable_checkpointing(), enable_recomputing():
            assert is_checkpointing() and is_recomputing()
        assert is_checkpointing() and not is_recomputing()  # the inner exit restores, not clears
    with disable_checkpointing():
        assert is_checkpointing_disabled()
    assert not (is_checkpointing() or is_recomputing() or is_checkpointing_disabled())


def test_forward_is_checkpointing_and_recomputation_is_recomputing() -> None:
    block = checkpoint_wrapper(Recorder())
    out = block(torch.randn(3, 4)).sum()
    assert not is_checkpointing()  # the flag ends with the checkpointed forward
    out.backward()
    assert [s[:2] for s in block.seen] == [(True, False), (False, True)]
    assert block.side_effects == 1  # the recomputation skipped the side effect
    assert not is_recomputing()


def test_recomputation_flag_on_another_backward_thread() -> None:
    """backward from a fresh thread (as autograd's device threads are on CUDA) still sees is_recomputing()."""
    block = checkpoint_wrapper(Recorder())
    out = block(torch.randn(3, 4)).sum()
    errors: list[BaseException] = []

    def run_backward() -> None:
        try:
            out.backward()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    worker = threading.Thread(target=run_backward)
    worker.start()
    worker.join(timeout=30)
    assert not errors and not worker.is_alive()
    (fwd_ckpt, fwd_recomp, fwd_thread), (re_ckpt, re_recomp, re_thread) = block.seen
    assert (fwd_ckpt, fwd_recomp) == (True, False)
    assert (re_ckpt, re_recomp) == (False, True)
    assert re_thread != fwd_thread  # the recomputation really ran on the other thread
    assert block.side_effects == 1


def test_flags_do_not_leak_to_other_threads() -> None:
    results: list[bool] = []
    with enable_recomputing(), enable_checkpointing(), disable_checkpointing():
        worker = threading.Thread(
            target=lambda: results.extend([is_recomputing(), is_checkpointing(), is_checkpointing_disabled()])
        )
        worker.start()
        worker.join(timeout=30)
    assert results == [False, False, False]


def test_disable_checkpointing_is_a_plain_forward_with_identical_gradients() -> None:
    torch.manual_seed(0)
    plain = Recorder()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(5, 4, requires_grad=True)
    plain(x).pow(2).sum().backward()
    grad_x_plain = x.grad.clone()
    x.grad = None
    with disable_checkpointing():
        out = wrapped(x)
    out.pow(2).sum().backward()  # backward outside the context: still nothing recomputed
    assert [s[:2] for s in wrapped.seen] == [(False, False)]
    for name, grad in _grads(plain).items():
        torch.testing.assert_close(_grads(wrapped)[name], grad, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, grad_x_plain, rtol=0, atol=0)


def test_disable_checkpointing_keeps_activations() -> None:
    """Inside the context the wrapper saves what a plain forward saves (more than the checkpointed one)."""
    block = checkpoint_wrapper(Recorder())
    x = torch.randn(64, 4, requires_grad=True)

    def saved_count() -> int:
        count = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal count
            count += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x)
        return count

    checkpointed = saved_count()
    with disable_checkpointing():
        plain = saved_count()
    assert plain > checkpointed


@pytest.mark.parametrize(
    "name",
    [
        "checkpoint_wrapper",
        "disable_checkpointing",
        "enable_checkpointing",
        "enable_recomputing",
        "is_checkpointing",
        "is_recomputing",
    ],
)
def test_fairscale_module_path_has_the_same_objects(name: str) -> None:
    import shardkit.nn.checkpoint as package

    assert getattr(fairscale_path, name) is getattr(package, name)
