"""The parameters seen as one flat vector: copies in and out of flat communication buffers.

SlowMo communicates whole parameter vectors (averages, gossip messages, slow-momentum shards). Copying them into
one flat buffer turns hundreds of small collectives into one, and lets the buffer live on ``comm_device`` (for
example the CPU for gloo while the parameters are on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from shardkit.nn._torch_private import view_base


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of the flat vector that share one learning rate."""

    start: int
    stop: int
    lr: float


class FlatParams:
    """A fixed list of tensors (the parameters the algorithm works on) laid end to end.

    The tensors must all be on one device; they may differ in dtype (buffers convert on copy).
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("SlowMo needs at least one parameter to synchronise")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(
                f"SlowMo needs every parameter on one device, found {sorted(map(str, devices))}; move the module to a "
                "single device before wrapping it"
            )
        self.tensors = list(tensors)
        self.device = self.tensors[0].device
        self.offsets: list[int] = []
        total = 0
        for t in self.tensors:
            self.offsets.append(total)
            total += t.numel()
        self.numel = total

    def new_buffer(self, dtype: torch.dtype, device: Optional[torch.device] = None, extra: int = 0) -> torch.Tensor:
        """An uninitialised flat buffer of ``numel + extra`` elements (pinned when it is a CPU staging buffer)."""
        device = device or self.device
        pin = device.type == "cpu" and self.device.type == "cuda"
        return torch.empty(self.numel + extra, dtype=dtype, device=device, pin_memory=pin)

    @torch.no_grad()
    def copy_to(self, flat: torch.Tensor) -> torch.Tensor:
        """Write the tensors into ``flat[:numel]``; returns ``flat``."""
        non_blocking = flat.device != self.device
        for t, offset in zip(self.tensors, self.offsets):
            flat[offset : offset + t.numel()].copy_(t.reshape(-1), non_blocking=non_blocking)
        if non_blocking and flat.device.type == "cpu" and self.device.type == "cuda":
            # A device-to-host copy must land before the host reads the buffer.
            torch.cuda.current_stream(self.device).synchronize()
        return flat

    @torch.no_grad()
    def copy_from(self, flat: torch.Tensor) -> None:
        """Overwrite the tensors with ``flat[:numel]``."""
        for t, offset in zip(self.tensors, self.offsets):
            t.copy_(flat[offset : offset + t.numel()].view_as(t), non_blocking=flat.device != self.device)

    def lr_segments(self, optimizer: torch.optim.Optimizer) -> list[Segment]:
        """The base learning rate of every element, as runs of equal learning rate.

        A tensor's rate comes from the optimizer group holding it (or the tensor it is a view of, for a flat fp32
        master copy); when a tensor is in no group, the optimizer must have a single learning rate.
        """
        by_id: dict[int, float] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                by_id[id(p)] = float(group["lr"])
        rates = {float(g["lr"]) for g in optimizer.param_groups}
        segments: list[Segment] = []
        for t, offset in zip(self.tensors, self.offsets):
            lr = by_id.get(id(t), by_id.get(id(base)) if (base := view_base(t)) is not None else None)
            if lr is None:
                if len(rates) != 1:
                    raise ValueError(
                        "perform_slowmo cannot tell which learning rate applies to a parameter: it is in no "
                        f"parameter group of the optimizer and the groups use different rates {sorted(rates)}. Pass "
                        "the optimizer that steps these parameters (or their fp32 copies)."
                    )
                lr = next(iter(rates))
            if lr <= 0:
                raise ValueError(f"the slow-momentum step divides by the learning rate, which is {lr}; use lr > 0")
            if segments and segments[-1].lr == lr and segments[-1].stop == offset:
                segments[-1] = Segment(segments[-1].start, offset + t.numel(), lr)
            else:
                segments.append(Segment(offset, offset + t.numel(), lr))
        return segments


def fp32_views(module_params: Sequence[torch.Tensor], fp32_params: object) -> list[torch.Tensor]:
    """Match ``fp32_params`` (a flat tensor, a list of tensors, or a one-entry dict of either) to the parameters."""
    if isinstance(fp32_params, dict):
        if len(fp32_params) != 1:
            raise ValueError(f"fp32_params as a dict must hold one entry, got keys {list(fp32_params)}")
        fp32_params = next(iter(fp32_params.values()))
    if isinstance(fp32_params, torch.Tensor):
        total = sum(p.numel() for p in module_params)
        if fp32_params.numel() != total:
            raise ValueError(f"fp32_params has {fp32_params.numel()} elements, the parameters {total}")
        flat = fp32_params.reshape(-1)
        views, offset = [], 0
        for p in module_params:
            views.append(flat[offset : offset + p.numel()])
            offset += p.numel()
        return views
    if isinstance(fp32_params, (list, tuple)):
        if len(fp32_params) != len(module_params) or any(
            not isinstance(f, torch.Tensor) or f.numel() != p.numel() for f, p in zip(fp32_params, module_params)
        ):
            raise ValueError("fp32_params as a list needs one tensor per parameter, each with the same numel")
        return list(fp32_params)
    raise TypeError(f"fp32_params must be a tensor, a list of tensors or a one-entry dict, got {type(fp32_params)}")


def groups_by_dtype(tensors: Sequence[torch.Tensor]) -> list[FlatParams]:
    """One :class:`FlatParams` per dtype among ``tensors`` (buffers mix float statistics and integer counters)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    return [FlatParams(group) for group in by_dtype.values()]
