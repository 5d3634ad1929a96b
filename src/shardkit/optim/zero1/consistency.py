"""Refusing ranks that handed OSS different parameters, before anything is broadcast or changed.

OSS partitions the parameters by their order, shapes and ``requires_grad`` flags, identically on every rank and
without communicating. If ranks built different models, their partitions disagree: owners broadcast buckets
the others lay out differently, so a step writes one rank's values into another's wrong tensors, or a transfer
of mismatched sizes hangs. :func:`check_same_params` catches that at construction.

The agreement itself is :func:`shardkit.distributed.model_check.check_same_signatures`, the one every wrapper's
same-model check runs: one all-gather of a short digest per rank, a second exchange only when they differ.

Hybrid sharding adds a second way to go wrong: the nodes' copies of a shard stay equal only if every node steps
with the same gradients, which the caller's gradient reduction must provide (torch DDP over the whole job, or
ShardedDataParallel given the same nodes). A DDP over one node's ranks leaves each node training on its own data
and the nodes drift apart without an error; :func:`check_replicas_agree` catches that at the first step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch

from shardkit.distributed.groups import GroupLike
from shardkit.distributed.model_check import TensorSignature, check_same_signatures
from shardkit.distributed.objects import all_gather_objects


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


def _grad_digest(grads: Sequence[Optional[torch.Tensor]]) -> list[Optional[float]]:
    """Each gradient's sum of squares in float64 (None where there is no gradient): equal gradients, equal digests."""
    present = [g for g in grads if g is not None]
    sums = torch.stack([g.detach().double().pow(2).sum() for g in present]).tolist() if present else []
    it = iter(sums)
    return [None if g is None else float(next(it)) for g in grads]


def _close(x: Optional[float], y: Optional[float]) -> bool:
    if x is None or y is None:
        return x is y
    if not (math.isfinite(x) and math.isfinite(y)):  # overflowed gradients are a scaler's business, not a drift
        return not (math.isfinite(x) or math.isfinite(y))
    return math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-30)


def _same(a: list[Optional[float]], b: list[Optional[float]]) -> bool:
    return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))


def check_replicas_agree(
    grads: Sequence[Optional[torch.Tensor]],
    param_groups: Sequence[dict[str, Any]],
    replica: GroupLike,
    group: GroupLike,
    who: str,
) -> None:
    """Raise on every rank unless the gradients of this rank's shard equal those of its replicas on the other nodes.

    ``grads`` are the gradients of the parameters this rank owns; ``replica`` the ranks owning the same shard on the
    other nodes; ``group`` this node's ranks. One object all-gather of a digest per gradient over ``replica``, then
    the verdict travels through :func:`check_same_params` over ``group``, so a mismatch on any node fails every rank
    (no rank goes on into the parameter exchange alone). Run it once, at the first step: a reduction that misses
    the other nodes shows from the first batch.
    """
    error: Optional[Exception] = None
    try:
        mine = _grad_digest(grads)
        seen = all_gather_objects(mine, replica, f"{who}.replica_check")
        if not all(_same(other, seen[0]) for other in seen):
            error = ValueError(
                f"{who}: with hybrid sharding each node keeps a copy of every shard, and the copies stay equal only "
                "if every node steps with the same gradients, but at the first step the gradients of one shard "
                f"differ between nodes (per-tensor sums of squares: {[d[:4] for d in seen]}). Average the "
                "gradients over every rank of the job before step(): wrap the model in torch "
                "DistributedDataParallel over the whole world (not one node's group), or in ShardedDataParallel "
                "with the same node description as OSS."
            )
    except Exception as exc:  # carried to every rank of the node below
        error = exc
    check_same_params(param_groups, group, who, local_error=error)
