"""One reason a plan cannot split a model at a degree: a size the degree must divide, or a module it cannot split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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
