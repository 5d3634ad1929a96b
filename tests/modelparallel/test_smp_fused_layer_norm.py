"""smp.nn.FusedLayerNorm against torch.nn.LayerNorm and the written-out formula, forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardkit.modelparallel as smp


def _formula(x: torch.Tensor, dims: int, w: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    axes = tuple(range(x.dim() - dims, x.dim()))
    mean = x.mean(dim=axes, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=axes, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [6, (3, 4)])
def test_matches_torch_layer_norm_and_formula(
    shape: int | tuple[int, int], affine: bool, memory_efficient: bool
) -> None:
    torch.manual_seed(0)
    ours = smp.nn.FusedLayerNorm(shape, eps=1e-4, elementwise_affine=affine, memory_efficient=memory_efficient)
    ref = nn.LayerNorm(shape, eps=1e-4, elementwise_affine=affine).double()
    if affine:
        assert ours.weight is not None and ours.bias is not None
        with torch.no_grad():  # non-trivial affine parameters, the same in both
            ours.weight.uniform_(0.5, 1.5)
            ours.bias.normal_()
            ref.weight.copy_(ours.weight)
            ref.bias.copy_(ours.bias)
    else:
        assert ours.weight is None and ours.bias is None and not list(ours.parameters())
    trailing = (shape,) if isinstance(shape, int) else shape
    x = (torch.randn(5, 2, *trailing) * 3 + 1).requires_grad_()
    x_ref = x.detach().double().requires_grad_()
    dy = torch.randn_like(x)

    y = ours(x)
    y_ref = ref(x_ref)
    by_hand = _formula(x_ref.detach(), len(trailing), ref.weight, ref.bias, 1e-4)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y.double(), by_hand.detach(), atol=1e-5, rtol=1e-5)

    y.backward(dy)
    y_ref.backward(dy.double())
    assert x.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(x.grad.double(), x_ref.grad, atol=1e-5, rtol=1e-4)
    if affine:
        assert ours.weight is not None and ours.bias is not None and ours.weight.grad is not None
        assert ours.bias.grad is not None and ref.weight.grad is not None and ref.bias.grad is not None
        torch.testing.assert_close(ours.weight.grad.double(), ref.weight.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.bias.grad.double(), ref.bias.grad, atol=1e-5, rtol=1e-4)


def test_memory_efficient_keeps_the_output_not_the_input() -> None:
    """The memory-efficient backward saves the output: the input's storage is not held by the graph."""
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.untyped_storage().data_ptr())
        return t

    for efficient in (False, True):
        saved.clear()
        norm = smp.nn.FusedLayerNorm(8, memory_efficient=efficient)
        x = torch.randn(4, 8, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = norm(x)
        assert (x.untyped_storage().data_ptr() in saved) is not efficient
        assert (y.untyped_storage().data_ptr() in saved) is efficient


def test_defaults_repr_and_bad_input() -> None:
    norm = smp.nn.FusedLayerNorm(4)
    assert norm.normalized_shape == torch.Size([4]) and norm.eps == 1e-5 and norm.elementwise_affine
    assert norm.weight is not None and torch.equal(norm.weight, torch.ones(4))
    assert "(4,), eps=1e-05, elementwise_affine=True" in repr(norm)
    with pytest.raises(ValueError, match=r"trailing dimensions must equal normalized_shape"):
        norm(torch.randn(2, 5))
    with pytest.raises(ValueError, match="normalized_shape must be positive"):
        smp.nn.FusedLayerNorm(0)
