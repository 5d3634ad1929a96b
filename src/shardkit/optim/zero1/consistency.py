"""Refusing ranks that handed OSS different parameters, before anything is broadcast or changed.

OSS partitions the parameters by their order, shapes and ``requires_grad`` flags, identically on every rank and
without communicating. If ranks built different models, their partitions disagree: owners broadcast buckets
the others lay out differently, so a step writes one rank's values into another's wrong tensors, or a transfer
of mismatched sizes hangs. :func:`check_same_params` catches that at construction.

In the common case it costs one all-gather of a short digest per rank. Only when the digests differ do the ranks
exchange their full signatures (a second all-gather, entered by every rank since all saw the same digests) to
name the first difference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Optional

from shardkit.distributed.groups import GroupLike, group_size, is_dummy
from shardkit.distributed.model_check import TensorSignature, describe_mismatch
from shardkit.distributed.objects import all_gather_objects


def params_signature(param_groups: Sequence[dict[str, Any]]) -> list[TensorSignature]:
    """Shape, dtype and ``requires_grad`` of every parameter, named by its param group and position."""
    return [
        TensorSignature("parameter", f"param_groups[{g}][{i}]", tuple(p.shape), str(p.dtype), p.requires_grad)
        for g, group in enumerate(param_groups)
        for i, p in enumerate(group["params"])
    ]


def _digest(signature: list[TensorSignature]) -> str:
    return hashlib.sha256(repr(signature).encode()).hexdigest()


def check_same_params(
    param_groups: Sequence[dict[str, Any]], group: GroupLike, who: str, local_error: Optional[Exception] = None
) -> None:
    """Raise on every member of ``group`` unless all hold the same parameter layout and none refused its arguments.

    The layout is the number of param groups, and each group's parameters' shapes, dtypes and ``requires_grad``
    in order; values and hyperparameters are not compared. ``local_error`` is what this rank's own checks raised,
    if anything: it travels in the same exchange, so a rank-specific failure fails every rank instead of leaving
    the others waiting in their next collective. This rank re-raises its own error; the others raise a
    ``ValueError`` quoting it.

    Example::

        check_same_params(optimizer.param_groups, group, "OSS")  # on every rank, before the first broadcast
    """
    if is_dummy(group) or group_size(group) == 1:
        if local_error is not None:
            raise local_error
        return
    signature = params_signature(param_groups) if local_error is None else []
    error_text = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    everyone = all_gather_objects((_digest(signature), error_text), group, f"{who}.param_check")
    if local_error is not None:
        raise local_error
    for rank, (_, error) in enumerate(everyone):
        if error is not None:
            raise ValueError(f"{who}: rank {rank} refused its arguments ({error}). Nothing was broadcast or changed.")
    if all(digest == everyone[0][0] for digest, _ in everyone):
        return
    signatures = all_gather_objects(signature, group, f"{who}.param_check_detail")
    for rank, other in enumerate(signatures[1:], start=1):
        problem = describe_mismatch(signatures[0], other, 0, rank)
        if problem is not None:
            raise ValueError(
                f"{who}: the ranks hold different parameters: {problem}. Every rank must pass the same parameters "
                "(same param groups, and in each the same number of tensors with the same shapes, dtypes and "
                "requires_grad, in the same order): build the same model on every rank; rank-specific parts need "
                "their own process group. Nothing was broadcast or changed."
            )
