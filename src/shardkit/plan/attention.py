"""Scaled dot-product attention planned as the device would run it, not as the meta device runs it.

``F.scaled_dot_product_attention`` picks a backend by the tensors' device: on CPU and on accelerators a fused
kernel (flash attention, memory-efficient attention) that keeps only the output and a float32 log-sum-exp per query
row for backward; on the meta device always the math fallback, which materialises the ``batch x heads x seq x seq``
attention weights, softmax and all, and saves them for backward. A plan on meta would therefore carry one phantom
quadratic tensor per layer (a 60M GPT at sequence 1024: +22% on DDP's peak). :class:`DeviceAttention` is a
``TorchFunctionMode`` that answers the call on meta tensors with the operator the planned device would choose:

- **CPU plans** (``target="cpu"``, a gloo run): torch's own choice, asked of small CPU stand-ins with the same
  dtypes, head counts, head sizes, mask, dropout and layout (``torch._fused_sdp_choice``), so the answer is the CPU
  run's, not a copy of its rules. Flash attention runs as ``aten._scaled_dot_product_flash_attention_for_cpu``, as
  the CPU composite calls it; anything else (dropout on CPU) runs the math path, exactly as on the CPU.
- **Accelerator plans** (``target="accelerator"``, an NCCL run): CUDA's order, by its documented constraints:
  flash attention for half-precision inputs without a mask (head size at most 256), else memory-efficient attention
  (any float dtype, masks allowed, the same number of key and query heads), else the math path. Both fused kernels
  keep what the CPU flash operator keeps (the output and a float32 log-sum-exp per row; the memory-efficient one
  rounds the rows up to 32), so flash is planned with that operator and memory-efficient attention with its own.
  Kernel workspaces are not tensors and are not planned.

Calls on real tensors pass through untouched (a planner run that fell back to the CPU takes the CPU's path itself).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten

#: Where the planned run executes attention.
TARGETS = ("cpu", "accelerator")

_SDPA = F.scaled_dot_product_attention
_SDPA_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in (
            ("query", inspect.Parameter.empty),
            ("key", inspect.Parameter.empty),
            ("value", inspect.Parameter.empty),
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
            ("scale", None),
            ("enable_gqa", False),
        )
    ]
)
_HALF = (torch.float16, torch.bfloat16)


def _stand_in(tensor: torch.Tensor, seq: int) -> torch.Tensor:
    """A small CPU tensor that torch's backend choice cannot tell from ``tensor``: batch 1, at most ``seq``
    positions, the same heads, head size, dtype, gradient flag and unit last stride (or not)."""
    shape = list(tensor.shape)
    shape[0] = 1
    shape[-2] = min(shape[-2], seq)
    if tensor.stride(-1) == 1 or tensor.shape[-1] == 1:
        out = torch.zeros(shape, dtype=tensor.dtype)
    else:  # a head dimension that is not contiguous in memory: the fused kernels refuse it
        out = torch.zeros([*shape[:-2], shape[-1], shape[-2]], dtype=tensor.dtype).transpose(-1, -2)
    return out.requires_grad_(tensor.requires_grad)


def _mask_stand_in(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``mask`` shrunk like the stand-ins it is applied to (broadcast dimensions stay 1)."""
    wanted = [1, query.shape[1], query.shape[2], key.shape[2]][4 - mask.dim() :]
    shape = [1 if size == 1 else target for size, target in zip(mask.shape, wanted)]
    if mask.dim() == 4:
        shape[0] = 1
    return torch.zeros(shape, dtype=mask.dtype).requires_grad_(mask.requires_grad)


def cpu_backend(call: inspect.BoundArguments) -> SDPBackend:
    """The backend the CPU would choose for ``call`` (bound to the SDPA signature), asked of torch itself."""
    a = call.arguments
    query, key, value, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.is_nested:
        return SDPBackend.MATH
    q, k, v = _stand_in(query, 2), _stand_in(key, 2), _stand_in(value, 2)
    m = _mask_stand_in(mask, q, k) if isinstance(mask, torch.Tensor) else None
    with torch.set_grad_enabled(torch.is_grad_enabled()):
        choice = torch._fused_sdp_choice(
            q, k, v, m, a["dropout_p"], a["is_causal"], scale=a["scale"], enable_gqa=a["enable_gqa"]
        )
    return SDPBackend(choice)


def accelerator_backend(call: inspect.BoundArguments) -> SDPBackend:
    """The backend a CUDA device would choose for ``call``, by the fused kernels' documented constraints."""
    a = call.arguments
    query, key, value, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.is_nested:
        return SDPBackend.MATH
    same_dtype = query.dtype == key.dtype == value.dtype
    head_dim = query.shape[-1]
    if same_dtype and query.dtype in _HALF and mask is None and head_dim <= 256 and value.shape[-1] == head_dim:
        return SDPBackend.FLASH_ATTENTION
    same_heads = query.shape[1] == key.shape[1] == value.shape[1]
    if same_dtype and query.dtype in (*_HALF, torch.float32) and same_heads:
        return SDPBackend.EFFICIENT_ATTENTION
    return SDPBackend.MATH


def _additive(mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """A boolean mask as the composite hands it to a fused kernel: additive, in the query's dtype (a new tensor
    the size of the mask, which autograd keeps for backward)."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(mask.logical_not(), float("-inf"))


def _efficient_bias(mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The mask as the memory-efficient kernel takes it: additive, its key dimension padded to a multiple of 16 (as
    the composite prepares it)."""
    mask = _additive(mask, query)
    keys = mask.shape[-1]
    if keys % 16:
        padded = F.pad(mask, (0, 16 - keys % 16))
        mask = padded[..., :keys]
    return mask


def fused_attention(backend: SDPBackend, call: inspect.BoundArguments) -> torch.Tensor:
    """Run ``call`` with the fused operator of ``backend`` (flash or memory-efficient)."""
    a = call.arguments
    query, key, value, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if backend == SDPBackend.FLASH_ATTENTION:
        if isinstance(mask, torch.Tensor):
            mask = _additive(mask, query)
        out = aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, a["dropout_p"], a["is_causal"], attn_mask=mask, scale=a["scale"]
        )
        return out[0]
    bias = _efficient_bias(mask, query) if isinstance(mask, torch.Tensor) else None
    needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out = aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, needs_lse, a["dropout_p"], a["is_causal"], scale=a["scale"]
    )
    return out[0]


_CHOOSERS: dict[str, Callable[[inspect.BoundArguments], SDPBackend]] = {
    "cpu": cpu_backend,
    "accelerator": accelerator_backend,
}


class DeviceAttention(TorchFunctionMode):
    """Answer ``F.scaled_dot_product_attention`` on meta tensors as the ``target`` device would run it.

    Example::

        with torch.device("meta"), DeviceAttention("cpu"):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention's tensors, not bmm's
    """

    def __init__(self, target: str) -> None:
        if target not in TARGETS:
            raise ValueError(f"DeviceAttention target must be one of {TARGETS}, got {target!r}")
        super().__init__()
        self.target = target
        #: Calls answered per backend name (what the plan assumed, for tests and notes).
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        call = _SDPA_SIGNATURE.bind(*args, **kwargs)
        call.apply_defaults()
        query = call.arguments["query"]
        if not isinstance(query, torch.Tensor) or query.device.type != "meta":
            return func(*args, **kwargs)
        backend = _CHOOSERS[self.target](call)
        self.calls[backend.name] = self.calls.get(backend.name, 0) + 1
        if backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            return fused_attention(backend, call)
        return func(*args, **kwargs)


def attention_target(backend: str) -> str:
    """The attention target of a run on the process-group ``backend``: gloo runs on CPUs, the rest on
    accelerators."""
    return "cpu" if backend == "gloo" else "accelerator"


__all__ = ["TARGETS", "DeviceAttention", "accelerator_backend", "attention_target", "cpu_backend", "fused_attention"]
