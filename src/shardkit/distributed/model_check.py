"""Refuse ranks that built different models, before any of their tensors is communicated.

A strategy that broadcasts rank 0's parameters or averages flat buffers assumes every rank holds the same
tensors in the same order. When they do not, the broadcast writes rank 0's values into the wrong tensors (or a
collective of different sizes hangs or aborts in the backend), and training goes on wrong or dies far from the
cause. :func:`check_same_model` compares the ranks' parameter and buffer signatures (one all-gather of a short
digest, a second of the signatures only when they differ) and raises the same ``ValueError`` on every rank, naming
the first difference and the ranks.

:func:`value_checksums` is the cheap evidence that ranks hold the same *values* (FSDP compares it at wrap time and
copies rank 0's tensors where it differs).

Example::

    check_same_model(module, group, who="SlowMoDistributedDataParallel")  # before the initial broadcast
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch
from torch import nn

from shardkit.distributed.groups import GroupLike
from shardkit.distributed.objects import all_gather_objects


class TensorSignature(NamedTuple):
    """What the ranks must agree on about one parameter or buffer."""

    kind: str  # "parameter" or "buffer"
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool

    def describe(self) -> str:
        """``parameter 'fc.weight' [4, 2] torch.float32`` (plus ``frozen`` for a parameter without gradient)."""
        frozen = " frozen" if self.kind == "parameter" and not self.requires_grad else ""
        return f"{self.kind} '{self.name}' {list(self.shape)} {self.dtype}{frozen}"


def model_signature(module: nn.Module, buffers: bool = True) -> list[TensorSignature]:
    """The name, shape, dtype and ``requires_grad`` of every parameter (then buffer) of ``module``, in order."""
    signature = [
        TensorSignature("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in module.named_parameters()
    ]
    if buffers:
        signature += [
            TensorSignature("buffer", name, tuple(b.shape), str(b.dtype), False) for name, b in module.named_buffers()
        ]
    return signature


def describe_mismatch(
    reference: list[TensorSignature], other: list[TensorSignature], reference_rank: int, other_rank: int
) -> Optional[str]:
    """What first differs between two ranks' signatures, or None when they agree."""
    for ref, mine in zip(reference, other):
        if ref != mine:
            return f"rank {reference_rank} has {ref.describe()} where rank {other_rank} has {mine.describe()}"
    if len(reference) != len(other):
        longer, owner = (reference, reference_rank) if len(reference) > len(other) else (other, other_rank)
        extra = longer[min(len(reference), len(other))]
        return (
            f"{extra.describe()} exists only on rank {owner} ({len(reference)} tensors on rank {reference_rank}, "
            f"{len(other)} on rank {other_rank})"
        )
    return None


def check_same_model(
    module: nn.Module,
    group: GroupLike,
    who: str,
    buffers: bool = True,
    local_error: Optional[Exception] = None,
) -> None:
    """Raise on every member of ``group`` unless all hold the same tensors and none refused its arguments.

    Compares names, shapes, dtypes and ``requires_grad`` of the parameters (and, with ``buffers``, of the
    buffers) with one all-gather; values are not compared (the caller's broadcast makes them equal). Every member
    must call it, before anything else is communicated or changed, so a mismatch leaves every rank untouched.

    ``local_error`` is the error this rank's own argument checks raised, if any: it travels in the same
    all-gather, so a check that fails on some ranks only (a rank-specific argument) fails on all of them instead
    of leaving the others waiting in their next collective. This rank re-raises its own error; the others raise
    a ``ValueError`` quoting the first failing rank's.

    Args:
        module: the model this rank is about to wrap.
        group: the ranks that must agree (real or dummy process group).
        who: the caller's name for the message, e.g. ``"SlowMoDistributedDataParallel"``.
        buffers: compare buffers too (when the caller broadcasts or averages them).
        local_error: what this rank's argument checks raised (None when they passed).

    Example::

        try:
            settings = validate(**kwargs)
            error = None
        except (TypeError, ValueError) as exc:
            error = exc
        check_same_model(module, group, "MyWrapper", local_error=error)  # raises everywhere, or nowhere
    """
    signature = model_signature(module, buffers) if isinstance(module, nn.Module) else []
    check_same_signatures(
        signature,
        group,
        who,
        local_error,
        what="models",
        advice=(
            "Build the same model on every rank (same parameter and buffer names, shapes, dtypes and "
            "requires_grad) before wrapping it; rank-specific parts need their own process group."
        ),
    )


def check_same_signatures(
    signature: list[TensorSignature],
    group: GroupLike,
    who: str,
    local_error: Optional[Exception],
    *,
    what: str,
    advice: str,
) -> None:
    """The agreement :func:`check_same_model` runs, for any list of signatures (OSS passes its param groups').

    In the common case it costs one all-gather of a short digest per rank (with each rank's argument-check error,
    if any); only when the digests differ do the ranks exchange their full signatures, in a second all-gather
    that every rank enters because all saw the same digests, to name the first difference. Raises on every
    rank, or on none: this rank re-raises ``local_error``, the others quote it; a mismatch raises
    ``"{who}: the ranks hold different {what}: <difference>. {advice} Nothing was broadcast or changed."``.
    """
    mine = (_digest(signature), None if local_error is None else _error_text(local_error))
    everyone = all_gather_objects(mine, group, f"{who}.signature_check")
    if local_error is not None:
        raise local_error
    for rank, (_, error) in enumerate(everyone):
        if error is not None:
            raise ValueError(f"{who}: rank {rank} refused its arguments ({error}). Nothing was broadcast or changed.")
    if all(digest == everyone[0][0] for digest, _ in everyone):
        return
    signatures = all_gather_objects(signature, group, f"{who}.signature_check_detail")
    for rank, other in enumerate(signatures[1:], start=1):
        problem = describe_mismatch(signatures[0], other, 0, rank)
        if problem is not None:
            raise ValueError(
                f"{who}: the ranks hold different {what}: {problem}. {advice} Nothing was broadcast or changed."
            )


#: Same-size integer dtype a floating-point tensor's bits are read as.
_BITS_AS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def value_checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The sum of each tensor's raw bits: equal on ranks holding equal values.

    Another initialisation or checkpoint changes it; values that differ only by their order need not (this is
    evidence for a refusal or a broadcast, not a cryptographic hash). The bits are read as 64-bit integers where
    the tensor's size allows (else as integers of the element's width) and summed with wrap-around: one pass over
    the memory where each tensor lives, no copies, one host synchronisation per device. Meta and empty tensors
    sum to 0.

    Example::

        mine = value_checksums(list(module.parameters()))   # compare across ranks with all_gather_objects
    """
    sums: dict[torch.device, list[torch.Tensor]] = {}
    where: list[tuple[torch.device, int]] = []
    for tensor in tensors:
        words = _words(tensor.detach())
        if words is None:
            device, total = torch.device("cpu"), torch.zeros((), dtype=torch.int64)
        else:
            device, total = words.device, words.sum(dtype=torch.int64)
        where.append((device, len(sums.setdefault(device, []))))
        sums[device].append(total)
    values = {device: torch.stack(totals).tolist() for device, totals in sums.items()}
    return [values[device][i] for device, i in where]


def _words(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """``tensor``'s bytes as a flat integer tensor, 64-bit where they fit (None for meta, empty or quantized).

    64-bit sums run at memory speed; widening ones (int32 summed into int64) are ~20x slower on CPU, so only
    tensors whose size is not a multiple of 8 bytes (small ones, in practice) take that path.
    """
    if tensor.is_meta or tensor.numel() == 0 or tensor.is_quantized:
        return None
    flat = tensor.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    elif flat.is_floating_point():
        flat = flat.view(_BITS_AS[flat.element_size()])
    if flat.element_size() < 8 and (flat.numel() * flat.element_size()) % 8 == 0:
        try:
            return flat.view(torch.int64)
        except RuntimeError:  # storage offset not 8-byte aligned: an aligned copy, so the sum stays the same
            return flat.clone().view(torch.int64)
    return flat


def _digest(signature: list[TensorSignature]) -> str:
    return hashlib.sha256(repr(signature).encode()).hexdigest()


def _error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"
