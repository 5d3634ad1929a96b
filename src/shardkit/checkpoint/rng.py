"""Random number generator states of one rank: torch CPU, the current CUDA device, Python and NumPy.

States are stored as tensors and plain Python data, so they read back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def capture() -> dict[str, Any]:
    """This process's generator states."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:  # NumPy is optional
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = [
        str(kind),
        torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        int(pos),
        int(has_gauss),
        float(cached),
    ]
    return state


def restore(state: dict[str, Any]) -> None:
    """Set this process's generators to ``state`` (from :func:`capture`); absent entries are left alone."""
    torch.set_rng_state(state["torch"])
    python = state.get("python")
    if python is not None:
        random.setstate(_as_tuples(python))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` wants the tuples ``getstate`` gave, whatever container the file returned."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value
