"""``smp.nn.FusedLayerNorm``: Apex's ``FusedLayerNorm`` arguments over torch's own layer norm kernel.

torch's ``layer_norm`` is already a single fused kernel on CPU and CUDA, so Apex is not needed. The one thing
Apex adds beyond torch is ``memory_efficient=True``: backward is computed from the layer's *output* instead of
its input, so the input can be freed as soon as the next layer no longer needs it (only the output, which the
next layer usually keeps anyway, and one inverse standard deviation per row are saved).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

ShapeLike = Union[int, Sequence[int], torch.Size]


class _OutputSavingLayerNorm(torch.autograd.Function):
    """Layer norm whose backward reads the output ``y`` (and ``1/std``) instead of the input.

    With ``y = xhat * w + b`` the normalised input is recovered as ``xhat = (y - b) / w``; the input gradient
    is ``rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))`` with ``dxhat = dy * w`` and the means
    over the normalised dimensions. This needs every element of ``w`` to be non-zero (as in Apex).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        shape: tuple[int, ...],
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        eps: float,
    ) -> torch.Tensor:
        y, _mean, rstd = torch.native_layer_norm(x, list(shape), weight, bias, eps)
        ctx.shape = shape
        ctx.save_for_backward(y, rstd, weight, bias)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        y, rstd, weight, bias = ctx.saved_tensors
        dims = tuple(range(y.dim() - len(ctx.shape), y.dim()))
        batch_dims = tuple(range(y.dim() - len(ctx.shape)))
        acc = torch.promote_types(y.dtype, torch.float32)  # reduce in at least fp32, as the fused kernels do
        y_acc, dy_acc = y.to(acc), dy.to(acc)
        xhat = y_acc if bias is None else y_acc - bias.to(acc)
        dxhat = dy_acc
        if weight is not None:
            xhat = xhat / weight.to(acc)
            dxhat = dy_acc * weight.to(acc)
        mean_dxhat = dxhat.mean(dim=dims, keepdim=True)
        mean_dxhat_xhat = (dxhat * xhat).mean(dim=dims, keepdim=True)
        dx = (rstd.to(acc) * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)).to(dy.dtype)
        dweight = (dy_acc * xhat).sum(dim=batch_dims).to(weight.dtype) if weight is not None else None
        dbias = dy_acc.sum(dim=batch_dims).to(bias.dtype) if bias is not None else None
        return dx, None, dweight, dbias, None


class FusedLayerNorm(nn.Module):
    """Layer normalisation over the last ``len(normalized_shape)`` dimensions (Apex's ``FusedLayerNorm``).

    ``y = (x - mean) / sqrt(var + eps) * weight + bias``, with mean and (biased) variance over the normalised
    dimensions, exactly ``torch.nn.LayerNorm``'s formula. Arguments as in Apex:

    Args:
        normalized_shape: size of the trailing dimension(s) to normalise (an int or a shape).
        eps: added to the variance for numerical stability.
        elementwise_affine: learn a per-element ``weight`` (ones) and ``bias`` (zeros); without it the layer
            has no parameters.
        memory_efficient: compute backward from the output instead of the input (see the module docstring);
            the result is the same, the input need not be kept. Requires non-zero weights.

    Example::

        norm = smp.nn.FusedLayerNorm(512)
        y = norm(torch.randn(8, 16, 512))
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, (int, numbers.Integral)):
            shape: tuple[int, ...] = (int(normalized_shape),)
        else:
            shape = tuple(int(s) for s in normalized_shape)
        if not shape or any(s <= 0 for s in shape):
            raise ValueError(f"FusedLayerNorm normalized_shape must be positive sizes, got {normalized_shape!r}")
        if not eps > 0:
            raise ValueError(f"FusedLayerNorm eps must be > 0, got {eps!r}")
        self.normalized_shape = torch.Size(shape)
        self.eps = float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.memory_efficient = bool(memory_efficient)
        if self.elementwise_affine:
            self.weight: Optional[nn.Parameter] = nn.Parameter(torch.ones(shape))
            self.bias: Optional[nn.Parameter] = nn.Parameter(torch.zeros(shape))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        """Weight back to ones and bias to zeros (when affine)."""
        if self.weight is not None and self.bias is not None:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` over its trailing ``normalized_shape`` dimensions."""
        if tuple(input.shape[input.dim() - len(self.normalized_shape) :]) != tuple(self.normalized_shape):
            raise ValueError(
                f"FusedLayerNorm({tuple(self.normalized_shape)}) got an input of shape {tuple(input.shape)}: its "
                "trailing dimensions must equal normalized_shape"
            )
        if self.memory_efficient and torch.is_grad_enabled():
            out: torch.Tensor = _OutputSavingLayerNorm.apply(
                input, tuple(self.normalized_shape), self.weight, self.bias, self.eps
            )
            return out
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        """Shape, eps and flags, as ``nn.LayerNorm`` prints them."""
        text = f"{tuple(self.normalized_shape)}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        return text + (", memory_efficient=True" if self.memory_efficient else "")
