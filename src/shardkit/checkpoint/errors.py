"""The errors :mod:`shardkit.checkpoint` raises: each says what is wrong with which file or key, and what to do."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class: a checkpoint could not be saved or loaded. Nothing was applied to the model or optimizer."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint exists where one was asked for."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is truncated, damaged, missing, or its directory was never completed."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds pickled objects other than tensors and plain data; it was refused unread."""


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """The checkpoint is intact but does not fit this run (other model, shapes, strategy or world size)."""
