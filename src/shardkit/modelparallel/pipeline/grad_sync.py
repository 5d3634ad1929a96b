"""Gradient reduction after a pipelined step: data parallel across replicas, and between copies of a parameter.

- Data parallel (``ddp=True``): this stage's gradients are averaged over the replicas holding the same stage,
  in buckets of ``bucket_cap_mb``. With ``overlapping_allreduce`` a bucket is all-reduced as soon as the last
  micro-batch's backward has produced all its gradients, while the rest of that backward still runs.
- Copies: a parameter held by several stages (tied weights, parameters used by code that runs on every stage)
  gets gradient contributions on each; they are summed over its holders so every copy takes the same step.

- Tensor parallelism: a parameter split across the tensor-parallel ranks (``smp.nn``'s distributed modules) is
  averaged over the reduced-data-parallel group instead (:class:`SplitReduction`), since its gradient already
  covers the batches of its tensor-parallel group.

Both run only every ``backward_passes_per_step`` steps, so gradients can accumulate locally in between.

With ``gradient_as_bucket_view`` (torch DDP's option of that name) each data-parallel bucket is one flat tensor
allocated once, and every parameter's ``.grad`` is a view into it: autograd accumulates straight into the
bucket, the all-reduce runs on it in place, and no second copy of the gradients exists at any time. A
gradient autograd created fresh (after ``zero_grad(set_to_none=True)``) is copied into its view on arrival
and replaced by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from shardkit.distributed import GroupLike
from shardkit.distributed import collectives as C
from shardkit.utils.autograd import weak_method_hook

#: Shared parameters at least this large are all-reduced in place instead of through a flat buffer.
_IN_PLACE_NUMEL = 1 << 18


def _flat_grads(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """Every gradient in one flat buffer (zeros where a parameter has none, so all ranks agree on sizes)."""
    return torch.cat(
        [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            for p in params
        ]
    )


def _write_back(params: Sequence[nn.Parameter], flat: torch.Tensor, scale: float) -> None:
    offset = 0
    for p in params:
        chunk = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        if scale != 1.0:
            chunk = chunk * scale
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)


@dataclass(frozen=True)
class SplitReduction:
    """Where the gradients of tensor-parallel split parameters are averaged: over ``group`` (reduced data
    parallel), divided by ``divisor`` (the batches their gradient covers in all)."""

    group: GroupLike
    divisor: int
    param_ids: frozenset[int]


class _Bucket:
    def __init__(self, params: list[nn.Parameter], as_view: bool, group: GroupLike, divisor: int) -> None:
        self.params = params
        self.group = group
        self.divisor = divisor
        self.ready = 0
        self.flat: Optional[torch.Tensor] = None
        self.handle: Optional[C.Handle] = None
        self.storage: Optional[torch.Tensor] = None
        """With ``gradient_as_bucket_view``: the bucket's flat gradients, which every ``.grad`` views."""
        self.views: dict[int, torch.Tensor] = {}
        if as_view:
            first = params[0]
            self.storage = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
            offset = 0
            for p in params:
                view = self.storage[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self.views[id(p)] = view

    def adopt(self, param: torch.Tensor) -> None:
        """Make ``param.grad`` its view into the bucket again (copying a fresh gradient in)."""
        view = self.views[id(param)]
        grad = param.grad
        if grad is None:  # no gradient this step (or dropped by zero_grad): contributes zeros
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        else:
            return
        param.grad = view

    def flat_grads(self) -> torch.Tensor:
        """The gradients to all-reduce: the bucket itself (views) or a fresh concatenation."""
        if self.storage is None:
            return _flat_grads(self.params)
        for p in self.params:
            self.adopt(p)
        return self.storage


class GradientSync:
    """Reduces one stage's gradients after each step (see the module docstring)."""

    def __init__(
        self,
        local_params: Sequence[nn.Parameter],
        dp_group: GroupLike,
        dp_size: int,
        copies: Sequence[tuple[GroupLike, list[nn.Parameter]]],
        bucket_cap_mb: float,
        overlap: bool,
        backward_passes_per_step: int,
        device: torch.device,
        gradient_as_bucket_view: bool = False,
        split: Optional[SplitReduction] = None,
    ) -> None:
        self.dp_group = dp_group
        self.device = device
        self.dp_size = dp_size
        self.copies = list(copies)
        self.overlap = overlap and dp_size > 1
        self.backward_passes_per_step = backward_passes_per_step
        self._passes = 0
        self._armed = False
        self.joining = False
        """Inside ``DistributedModel.join()``: every step also tells joined replicas what it reduces."""
        # Buckets only exist to reduce across replicas; without replicas gradients stay as autograd made them.
        self.as_view = gradient_as_bucket_view and dp_size > 1
        trainable = [p for p in local_params if p.requires_grad]
        cap = max(1, int(bucket_cap_mb * 2**20))
        split_ids = split.param_ids if split is not None else frozenset()
        self._buckets = self._make_buckets([p for p in trainable if id(p) not in split_ids], cap, dp_group, dp_size)
        if split is not None:
            mine = [p for p in trainable if id(p) in split_ids]
            self._buckets += self._make_buckets(mine, cap, split.group, split.divisor)
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._hooks: list[Any] = []
        if self.overlap or self.as_view:
            self._hooks = [p.register_post_accumulate_grad_hook(weak_method_hook(self._on_grad)) for p in trainable]

    def _make_buckets(self, params: list[nn.Parameter], cap: int, group: GroupLike, divisor: int) -> list[_Bucket]:
        # Reverse registration order approximates the order backward produces gradients (as DDP assumes).
        buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            if current and (size + p.numel() * p.element_size() > cap or p.dtype != current[0].dtype):
                buckets.append(_Bucket(current, self.as_view, group, divisor))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(_Bucket(current, self.as_view, group, divisor))
        return buckets

    def _reduces_this_step(self) -> bool:
        """Gradients are reduced on every ``backward_passes_per_step``-th step with a backward pass."""
        return (self._passes + 1) % self.backward_passes_per_step == 0

    def arm(self) -> None:
        """The next backward is the step's last: reduce buckets as they fill."""
        # While joining, buckets go out in a fixed order, which replicas that ran out of data can mirror.
        self._armed = self.overlap and self._reduces_this_step() and not self.joining
        for bucket in self._buckets:
            bucket.ready, bucket.flat, bucket.handle = 0, None, None

    def _on_grad(self, param: torch.Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        if self.as_view:
            bucket.adopt(param)
        if not self._armed:
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.flat = bucket.flat_grads()
        bucket.handle = C.all_reduce(bucket.flat, group=bucket.group, async_op=True, label="smp_ddp_bucket")

    def finish(self, had_backward: bool) -> None:
        """Complete the step's reductions (when this step reduces and a backward ran)."""
        armed, self._armed = self._armed, False
        reduce_now = had_backward and self._reduces_this_step()
        if had_backward:
            self._passes += 1
        if self.joining:
            self.join_flag(int(reduce_now and self.dp_size > 1))
        if not reduce_now:
            return
        if self.dp_size > 1:
            for bucket in self._buckets:
                if not armed or bucket.handle is None:
                    self._launch(bucket)
            for bucket in self._buckets:
                assert bucket.handle is not None and bucket.flat is not None
                bucket.handle.wait()
                if bucket.storage is not None:  # the gradients are views of what was just reduced
                    bucket.storage.div_(bucket.divisor)
                else:
                    _write_back(bucket.params, bucket.flat, 1.0 / bucket.divisor)
                bucket.flat, bucket.handle = None, None
        for group, params in self.copies:
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in params:
                if p.numel() >= _IN_PLACE_NUMEL:  # big (a tied embedding): reduce in place, no flat copies
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    C.all_reduce(p.grad, group=group, label="smp_shared_param_grads")
                else:
                    by_dtype.setdefault(p.dtype, []).append(p)
            for same in by_dtype.values():
                flat = _flat_grads(same)
                C.all_reduce(flat, group=group, label="smp_shared_param_grads")
                _write_back(same, flat, 1.0)

    def join_flag(self, value: int) -> int:
        """Sum of ``value`` over the replicas (one round of the join protocol)."""
        flag = torch.tensor([value], dtype=torch.int64, device=self.device)
        C.all_reduce(flag, group=self.dp_group, label="smp_join_flag")
        return int(flag.item())

    def shadow_reduction(self) -> None:
        """A replica without data mirrors the others' bucket all-reduces with zeros (DDP's join semantics:
        gradients are still divided by the full number of replicas)."""
        for bucket in self._buckets:
            first = bucket.params[0]
            zeros = torch.zeros(sum(p.numel() for p in bucket.params), dtype=first.dtype, device=first.device)
            C.all_reduce(zeros, group=bucket.group, label="smp_ddp_bucket")

    def close(self) -> None:
        """Remove the gradient hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
