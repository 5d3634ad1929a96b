"""What the fused optimizers share: batches of tensors per device and dtype, fp32 maths, per-parameter steps."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# torch's multi-tensor kernels (private names, imported once in modelparallel._torch_private), re-exported for the
# optimizers, which call them as ``F.foreach_*``.
from shardkit.modelparallel._torch_private import (
    foreach_add_,
    foreach_addcmul_,
    foreach_copy_,
    foreach_div,
    foreach_div_,
    foreach_mul,
    foreach_mul_,
    foreach_norm,
    foreach_sqrt_,
)

#: Low-precision parameters are updated in fp32 (as Apex's kernels do) and written back.
_UPCAST = (torch.float16, torch.bfloat16)


@dataclass
class Batch:
    """The parameters of one group that share a device and dtype, with their gradients and state."""

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)


def batches(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], who: str
) -> Iterator[tuple[torch.device, torch.dtype, Batch]]:
    """The parameters of ``group`` that have a gradient, batched by (device, dtype); checks what Apex checks."""
    found: dict[tuple[torch.device, torch.dtype], Batch] = {}
    for p in group["params"]:
        if p.grad is None:
            continue  # a parameter this stage does not hold, or one that took no part in the loss
        if p.grad.is_sparse:
            raise RuntimeError(f"{who} does not support sparse gradients; use torch.optim.SparseAdam for them")
        if not p.is_floating_point():
            raise RuntimeError(f"{who} updates floating-point parameters only, got one of dtype {p.dtype}")
        batch = found.setdefault((p.device, p.dtype), Batch())
        batch.params.append(p)
        batch.grads.append(p.grad)
        batch.states.append(optimizer.state[p])
    for (device, dtype), batch in found.items():
        yield device, dtype, batch


@contextmanager
def fp32_math(dtype: torch.dtype, *lists: list[torch.Tensor]) -> Iterator[list[list[torch.Tensor]]]:
    """Tensors to update in place, in at least fp32: fp16/bf16 ones (parameters and their state, which is
    kept in the parameter's dtype as in Apex) are copied up, updated, and written back on exit."""
    if dtype not in _UPCAST:
        yield [[t.detach() for t in tensors] for tensors in lists]
        return
    work = [[t.detach().float() for t in tensors] for tensors in lists]
    yield work
    for tensors, updated in zip(lists, work):
        foreach_copy_([t.detach() for t in tensors], updated)


def as_fp32(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` in fp32 (the same tensors when they already are, copies otherwise)."""
    return [t if t.dtype != torch.float16 and t.dtype != torch.bfloat16 else t.float() for t in tensors]


def advance_steps(states: Sequence[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """Add one to each parameter's ``step`` (created at 0) and return the new counts as one fp32 tensor."""
    for state in states:
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
    steps = [state["step"] for state in states]
    foreach_add_(steps, 1.0)
    return torch.stack(steps).to(device=device, dtype=torch.float32)


def zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
    """Apex's ``zero_grad``: drop the gradients (``set_grad_none``) or zero them in place."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()


def check_betas(who: str, betas: Any) -> tuple[float, float]:
    """``betas`` as two floats in [0, 1), or a clear error."""
    try:
        beta1, beta2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(f"{who} betas must be a pair of floats, got {betas!r}") from None
    for name, value in (("betas[0]", beta1), ("betas[1]", beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{who} {name} must be in [0, 1), got {value}")
    return beta1, beta2


def check_non_negative(who: str, **values: float) -> None:
    """Each named value must be a number >= 0."""
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{who} {name} must be a number >= 0, got {value!r}")


__all__ = [
    "Batch",
    "advance_steps",
    "as_fp32",
    "batches",
    "check_betas",
    "check_non_negative",
    "foreach_add_",
    "foreach_addcmul_",
    "foreach_copy_",
    "foreach_div",
    "foreach_div_",
    "foreach_mul",
    "foreach_mul_",
    "foreach_norm",
    "foreach_sqrt_",
    "fp32_math",
    "zero_grad",
]
