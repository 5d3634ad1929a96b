"""Scaled dot-product attention planned as the device would run it, not as the meta device runs it.

``F.scaled_dot_product_attention`` picks a backend by the tensors' device: on CPU and on accelerators a fused
kernel (flash attention, memory-efficient attention) that keeps only the output and a float32 log-sum-exp per query
row for backward; on the meta device always the math fallback, which materialises the ``batch x heads x seq x seq``
attention weights, softmax and all, and saves them for backward. A plan on meta would therefore carry one phantom
quadratic tensor per layer (a 51M GPT-2 at sequence 1024: +15.5% on DDP's peak, +19.6% on FSDP's). While a
:class:`DeviceAttention` is open, SDPA on meta tensors is answered with the operator the planned device would choose:

- **CPU plans** (``target="cpu"``, a gloo run): torch's own choice, asked of small CPU stand-ins with the same
  dtypes, head counts, head sizes, mask, dropout and layout (``torch._fused_sdp_choice``), so the answer is the CPU
  run's, not a copy of its rules. Flash attention runs as ``aten._scaled_dot_product_flash_attention_for_cpu``, as
  the CPU composite calls it; anything else (dropout on CPU) runs the math path, exactly as on the CPU.
- **Accelerator plans** (``target="accelerator"``, an NCCL run): CUDA's order (sm80 and newer), by its documented
  constraints: flash attention for half-precision inputs without a mask (one head size of at most 256, padded to a
  multiple of 8 in copies the kernel keeps; ``is_causal`` only as many keys as queries; grouped-query attention
  with ``enable_gqa``), else memory-efficient attention (float32 or half precision, masks allowed, head sizes and
  storage offsets a multiple of 8 elements in half precision, 4 in float32, the same number of heads), else the
  math path. Dropout is taken by both fused kernels, which keep only its random state. Both keep the output and a
  float32 log-sum-exp per row; the memory-efficient one also the mask, made additive in the query's dtype and, where
  its strides are not multiples of 8, padded. Kernel workspaces are not tensors and are not planned. The math path
  on meta keeps dropout's mask in the weights' dtype where CUDA keeps one byte per element: that over-plans, never
  under-plans. An accelerator plan names the calls a CPU run would take on the math path instead (its note), since
  a CPU run of the same model can hold far more (issue 32, item 15).

How: a kernel for ``aten::scaled_dot_product_attention`` at the ``AutogradMeta`` dispatch key, registered once per
process, so only meta tensors reach it and it runs wherever the call comes from: a ``TorchFunctionMode`` would be
popped while ``loss.backward()`` runs through it, and a checkpointed block recomputed in backward would then take
the math path its forward did not (torch's checkpoint refuses the mismatch). Outside a :class:`DeviceAttention` the
kernel runs the operator's own composite, exactly what meta tensors ran before. Real tensors never reach it (a
planner run that fell back to the CPU takes the CPU's path itself).
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from shardkit.plan._torch_private import (
    disable_current_modes,
    efficient_attention,
    flash_attention_for_cpu,
    fused_sdp_choice,
)

aten = torch.ops.aten

#: Where the planned run executes attention.
TARGETS = ("cpu", "accelerator")
_HALF = (torch.float16, torch.bfloat16)


@dataclass
class SdpaCall:
    """One ``scaled_dot_product_attention`` call's arguments."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: Optional[float] = None
    enable_gqa: bool = False


def _stand_in(tensor: torch.Tensor, seq: int) -> torch.Tensor:
    """A small CPU tensor that torch's backend choice cannot tell from ``tensor``: batch 1, at most ``seq``
    positions, the same heads, head size, dtype, gradient flag and unit last stride (or not)."""
    shape = list(tensor.shape)
    shape[0] = 1
    shape[-2] = min(shape[-2], seq)
    if tensor.stride(-1) == 1 or tensor.shape[-1] == 1:
        out = torch.zeros(shape, dtype=tensor.dtype, device="cpu")
    else:  # a head dimension that is not contiguous in memory: the fused kernels refuse it
        out = torch.zeros([*shape[:-2], shape[-1], shape[-2]], dtype=tensor.dtype, device="cpu").transpose(-1, -2)
    return out.requires_grad_(tensor.requires_grad)


def _mask_stand_in(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``mask`` shrunk like the stand-ins it is applied to (broadcast dimensions stay 1)."""
    wanted = [1, query.shape[1], query.shape[2], key.shape[2]][4 - mask.dim() :]
    shape = [1 if size == 1 else target for size, target in zip(mask.shape, wanted)]
    if mask.dim() == 4:
        shape[0] = 1
    return torch.zeros(shape, dtype=mask.dtype, device="cpu").requires_grad_(mask.requires_grad)


def cpu_backend(call: SdpaCall) -> SDPBackend:
    """The backend the CPU would choose for ``call``, asked of torch itself."""
    query, key, value, mask = call.query, call.key, call.value, call.attn_mask
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.is_nested:
        return SDPBackend.MATH
    # The stand-ins are not the planned run's memory: made with the planner's dispatch modes set aside.
    with disable_current_modes():
        q, k, v = _stand_in(query, 2), _stand_in(key, 2), _stand_in(value, 2)
        m = _mask_stand_in(mask, q, k) if isinstance(mask, torch.Tensor) else None
        choice = fused_sdp_choice(
            q, k, v, m, call.dropout_p, call.is_causal, scale=call.scale, enable_gqa=call.enable_gqa
        )
    return SDPBackend(choice)


def _dense_4d(call: SdpaCall) -> bool:
    """Query, key and value are 4-D dense tensors of one dtype and one batch size with work to do: the fused kernels
    take nothing else."""
    query, key, value = call.query, call.key, call.value
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.is_nested:
        return False
    same_batch = query.shape[0] == key.shape[0] == value.shape[0]
    nonempty = query.shape[-2] > 0 and key.shape[-2] > 0
    return query.dtype == key.dtype == value.dtype and same_batch and nonempty


def _heads_fit(call: SdpaCall, grouped: bool) -> bool:
    """The same number of heads everywhere, or (where the kernel takes grouped-query attention) ``enable_gqa`` with
    key heads dividing the query heads."""
    heads, key_heads, value_heads = call.query.shape[1], call.key.shape[1], call.value.shape[1]
    if heads == key_heads == value_heads:
        return True
    return grouped and call.enable_gqa and key_heads == value_heads and heads % key_heads == 0


def _unit_last_stride(tensor: torch.Tensor, allow_single: bool) -> bool:
    return tensor.stride(-1) == 1 or (allow_single and tensor.shape[-1] == 1)


def flash_takes(call: SdpaCall) -> bool:
    """Whether CUDA's flash attention (sm80 and newer) takes ``call``: half precision, no mask, one head size of at
    most 256 for query, key and value, ``is_causal`` only with as many keys as queries, unit last strides;
    grouped-query attention with ``enable_gqa``. Dropout is taken (the kernel keeps only its random state)."""
    query, key, value = call.query, call.key, call.value
    head = query.shape[-1]
    square = query.shape[-2] == key.shape[-2]
    strides = all(_unit_last_stride(t, allow_single=True) for t in (query, key, value))
    return (
        query.dtype in _HALF
        and call.attn_mask is None
        and head == key.shape[-1] == value.shape[-1]
        and head <= 256
        and (square or not call.is_causal)
        and strides
        and _heads_fit(call, grouped=True)
    )


def efficient_takes(call: SdpaCall) -> bool:
    """Whether CUDA's memory-efficient attention takes ``call``: float32 or half precision, masks and dropout allowed,
    query and key of one head size, head sizes a multiple of the kernel's alignment (8 elements in half precision,
    4 in float32 on sm80 and newer) and storage offsets too, unit last strides (the mask's included), the same number
    of heads (grouped-query attention is planned on the math path: not every torch release's kernel takes it, and
    the math path is the larger plan)."""
    query, key, value, mask = call.query, call.key, call.value, call.attn_mask
    align = 8 if query.dtype in _HALF else 4
    sizes = query.shape[-1] == key.shape[-1] and query.shape[-1] % align == 0 and value.shape[-1] % align == 0
    offsets = all(t.storage_offset() % align == 0 for t in (query, key, value))
    strides = all(_unit_last_stride(t, allow_single=False) for t in (query, key, value))
    mask_stride = not isinstance(mask, torch.Tensor) or mask.stride(-1) == 1
    return (
        query.dtype in (*_HALF, torch.float32)
        and sizes
        and offsets
        and strides
        and mask_stride
        and _heads_fit(call, grouped=False)
    )


def accelerator_backend(call: SdpaCall) -> SDPBackend:
    """The backend a CUDA device (sm80 or newer) would choose for ``call``, by the fused kernels' documented
    constraints, in torch's order: flash attention, memory-efficient attention, the math path. (Where torch prefers
    cuDNN attention, on sm90/sm100 with a recent cuDNN, it takes a subset of these calls and keeps what the
    memory-efficient kernel keeps, at most.)"""
    if not _dense_4d(call):
        return SDPBackend.MATH
    if flash_takes(call):
        return SDPBackend.FLASH_ATTENTION
    if efficient_takes(call):
        return SDPBackend.EFFICIENT_ATTENTION
    return SDPBackend.MATH


def _additive(mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """A boolean mask as the composite hands it to a fused kernel: additive, in the query's dtype (a new tensor
    the size of the mask, which autograd keeps for backward)."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(mask.logical_not(), float("-inf"))


def _efficient_bias(mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The mask as the composite hands it to the memory-efficient kernel: additive, and where its strides are not
    multiples of 8 elements, copied with its key dimension padded by up to 8 (then sliced back); broadcast over
    batch and heads as a view, never materialised."""
    mask = _additive(mask, query)
    aligned = mask.stride(-1) == 1 and all(stride % 8 == 0 for stride in mask.stride()[:-1])
    if not aligned:
        keys = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - keys % 8))[..., :keys]
    return mask


def _flash_padded(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its head dimension padded to a multiple of 8, as the composite hands it to CUDA's flash
    kernel (a copy, which the kernel keeps for backward, where the head size is not a multiple of 8)."""
    head = tensor.shape[-1]
    return tensor if head % 8 == 0 else F.pad(tensor, (0, 8 - head % 8))


def fused_attention(backend: SDPBackend, call: SdpaCall, accelerator: bool = False) -> torch.Tensor:
    """Run ``call`` with the fused operator of ``backend`` (flash or memory-efficient), with the inputs prepared as
    the composite prepares them for CUDA when ``accelerator`` is set."""
    query, key, value, mask = call.query, call.key, call.value, call.attn_mask
    if backend == SDPBackend.FLASH_ATTENTION:
        if isinstance(mask, torch.Tensor):  # the CPU's flash kernel takes masks, CUDA's is never given one
            mask = _additive(mask, query)
        head = query.shape[-1]
        scale = call.scale if call.scale is not None else head**-0.5  # of the head size before any padding
        if accelerator:
            query, key, value = (_flash_padded(t) for t in (query, key, value))
        out: torch.Tensor = flash_attention_for_cpu(
            query, key, value, call.dropout_p, call.is_causal, attn_mask=mask, scale=scale
        )[0]
        return out if out.shape[-1] == head else out[..., :head]
    bias = _efficient_bias(mask, query) if isinstance(mask, torch.Tensor) else None
    needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out = efficient_attention(query, key, value, bias, needs_lse, call.dropout_p, call.is_causal, scale=call.scale)
    return out[0]


_CHOOSERS: dict[str, Callable[[SdpaCall], SDPBackend]] = {
    "cpu": cpu_backend,
    "accelerator": accelerator_backend,
}


class DeviceAttention:
    """Within the block, SDPA on meta tensors runs as the ``target`` device would run it (this thread and
    context; see the module docstring).

    Example::

        with DeviceAttention("cpu") as attention, torch.device("meta"):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention's tensors, not bmm's
        assert attention.calls == {"FLASH_ATTENTION": 1}
    """

    def __init__(self, target: str) -> None:
        if target not in TARGETS:
            raise ValueError(f"DeviceAttention target must be one of {TARGETS}, got {target!r}")
        self.target = target
        #: Calls answered per backend name (what the plan assumed).
        self.calls: dict[str, int] = {}
        #: Accelerator plans: calls planned with a fused kernel that a CPU run would take on the math path, keeping
        #: the ``batch x heads x seq x seq`` attention weights for backward (dropout on the CPU, for one).
        self.math_on_cpu = 0
        self._token: Optional[contextvars.Token[Optional[DeviceAttention]]] = None

    def answer(self, call: SdpaCall) -> Optional[torch.Tensor]:
        """The fused kernel's output for ``call``, or None where the device runs the math path too."""
        backend = _CHOOSERS[self.target](call)
        self.calls[backend.name] = self.calls.get(backend.name, 0) + 1
        if self.target == "accelerator" and backend != SDPBackend.MATH and cpu_backend(call) == SDPBackend.MATH:
            self.math_on_cpu += 1
        if backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            return fused_attention(backend, call, accelerator=self.target == "accelerator")
        return None

    def __enter__(self) -> DeviceAttention:
        _register_meta_kernel()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None


#: The DeviceAttention open in this context, if any (read by the meta kernel, on the thread running the op).
_ACTIVE: contextvars.ContextVar[Optional[DeviceAttention]] = contextvars.ContextVar(
    "shardkit_plan_device_attention", default=None
)
_SDPA_OP = aten.scaled_dot_product_attention.default


def _meta_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA on meta tensors: the open DeviceAttention's answer, else the operator's own composite (math)."""
    active = _ACTIVE.get()
    if active is not None:
        call = SdpaCall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        out = active.answer(call)
        if out is not None:
            return out
    result: torch.Tensor = _SDPA_OP.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return result


@functools.cache
def _register_meta_kernel() -> torch.library.Library:
    """Register :func:`_meta_sdpa` for meta tensors, once per process (the cache keeps the registration alive)."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("scaled_dot_product_attention", _meta_sdpa, "AutogradMeta")
    return library


def attention_note(attention: DeviceAttention) -> str:
    """The estimate's note on the kernels planned, and for an accelerator plan, which calls a CPU run would hold
    more for: the plan is for the accelerator, a gloo run on CPUs is planned with ``backend="gloo"``."""
    kernels = ", ".join(f"{name.lower()} ({count} calls)" for name, count in attention.calls.items())
    note = f"scaled_dot_product_attention planned as the {attention.target} runs it: {kernels}"
    if attention.math_on_cpu:
        note += (
            f"; on a CPU, {attention.math_on_cpu} of these calls take the math path instead, which keeps each "
            "call's batch x heads x seq x seq attention weights for backward (far more memory): to plan a CPU run "
            "on gloo, pass backend='gloo' (shardkit plan --backend gloo)"
        )
    return note


def attention_target(backend: str) -> str:
    """The attention target of a run on the process-group ``backend``: gloo runs on CPUs, the rest on
    accelerators."""
    return "cpu" if backend == "gloo" else "accelerator"


__all__ = [
    "TARGETS",
    "DeviceAttention",
    "SdpaCall",
    "accelerator_backend",
    "attention_note",
    "attention_target",
    "cpu_backend",
    "efficient_takes",
    "flash_takes",
    "fused_attention",
]
