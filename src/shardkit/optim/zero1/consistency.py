"""Refusing ranks that handed OSS different parameters, before anything is broadcast or changed.

OSS partitions the parameters by their order, shapes and ``requires_grad`` flags, identically on every rank and
without communicating. If ranks built different models, their partitions disagree: owners broadcast buckets
the others lay out differently, so a step writes one rank's values into another's wrong tensors, or a transfer
of mismatched sizes hangs. :func:`check_same_params` catches that at construction.

The agreement itself is :func:`shardkit.distributed.model_check.check_same_signatures`, the one every wrapper's
same-model check runs: one all-gather of a short digest per rank, a second exchange only when they differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from shardkit.distributed.groups import GroupLike
from shardkit.distributed.model_check import TensorSignature, check_same_signatures


def params_signature(param_groups: Sequence[dict[str, Any]]) -> list[TensorSignature]:
    """Shape, dtype and ``requires_grad`` of every parameter, named by its param group and position."""
    return [
        TensorSignature("parameter", f"param_groups[{g}][{i}]", tuple(p.shape), str(p.dtype), p.requires_grad)
        for g, group in enumerate(param_groups)
        for i, p in enumerate(group["params"])
    ]


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
    signature = params_signature(param_groups) if local_error is None else []
    check_same_signatures(
        signature,
        group,
        who,
        local_error,
        what="parameters",
        advice=(
            "Every rank must pass the same parameters (same param groups, and in each the same number of tensors "
            "with the same shapes, dtypes and requires_grad, in the same order): build the same model on every "
            "rank; rank-specific parts need their own process group."
        ),
    )
