"""Keep normalisation running statistics from being updated a second time by a recomputed forward.

A training-mode BatchNorm (or InstanceNorm with ``track_running_stats=True``) folds every forward's batch
statistics into its running mean and variance and bumps its batch counter. Recomputing the forward for
activation checkpointing would fold the same batch in twice. The layer's training-mode output never reads the
running statistics, so restoring them after the recomputation is exact; the copies cost two vectors of the
channel count per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _tracked_stats(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, snapshot) for every running statistic in ``module`` and its descendants."""
    snapshots = []
    for sub in module.modules():
        if not getattr(sub, "track_running_stats", False):
            continue
        for name in _STAT_BUFFERS:
            buf = sub._buffers.get(name)
            if buf is not None:
                snapshots.append((buf, buf.detach().clone()))
    return snapshots


@contextlib.contextmanager
def restore_norm_stats_after(module: nn.Module) -> Iterator[None]:
    """Run the body, then put every running statistic under ``module`` back to its value at entry.

    Used as the recomputation context of a checkpointed region. It restores on any exit, including the early
    stop torch's checkpoint raises once it has recomputed the tensors backward needs.
    """
    snapshots = _tracked_stats(module)
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, saved in snapshots:
                buf.copy_(saved)
