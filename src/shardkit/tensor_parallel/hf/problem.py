"""One reason a plan cannot split a model at a degree: a size the degree must divide, or a module it cannot split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, TypeVar

from torch import nn
from typing_extensions import TypeGuard  # typing.TypeGuard is 3.10+; torch depends on typing_extensions

M = TypeVar("M", bound=nn.Module)


def is_exactly(module: object, kind: type[M]) -> TypeGuard[M]:
    """Whether ``module`` is a ``kind`` and not a subclass: a subclass may do more in ``forward`` than the split
    layer that replaces it would (Gemma's embedding scales its output; LoRA and quantized linears add terms)."""
    return type(module) is kind


def is_hf_conv1d(module: object) -> bool:
    """Whether ``module`` is transformers' own ``Conv1D`` (``y = x W + b``, ``W`` stored ``(in, out)``)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - a model with an HF Conv1D brings transformers
        return False
    return type(module) is Conv1D


@dataclass(frozen=True)
class Problem:
    """A module path and what about it matters: a size the degree must divide (``size``), or, without a size, a
    reason the plan cannot split it at all."""

    path: str
    what: str
    size: Optional[int] = None

    def describe(self) -> str:
        """``'h.0.attn': num_heads=4`` or ``'h.0.attn': is Linear, not HF Conv1D``."""
        return f"'{self.path}': {self.what}" + (f"={self.size}" if self.size is not None else "")
