"""The settings of :class:`~shardkit.nn.sharded_ddp.ShardedDataParallel`, grouped by the piece that reads them.

The public constructor keeps fairscale's flat keyword arguments; it translates them at once into these frozen
dataclasses, validated here, so the internals never see the loose flags.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardkit.distributed.buckets import REDUCE_BUCKET_BYTES


@dataclass(frozen=True)
class ReducePolicy:
    """How gradients travel to their owners."""

    #: Upper bound of one flat buffer that packs several gradients bound for the same owner rank into one reduce
    #: (``reduce_buffer_size``). 0 reduces every gradient on its own.
    bucket_bytes: int = REDUCE_BUCKET_BYTES
    #: Send fp32 gradients as fp16 (half the bytes, about three decimal digits of precision).
    reduce_fp16: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 0:
            raise ValueError(
                f"reduce_buffer_size must be a non-negative number of bytes, got {self.bucket_bytes!r}; "
                "use 0 to reduce every gradient on its own"
            )
        _check_flag("reduce_fp16", self.reduce_fp16)

    @property
    def small_bytes(self) -> int:
        """Largest gradient that is packed into a bucket; bigger ones are reduced in their own tensor.

        An eighth of a bucket (1 MiB by default): packing pays off for latency-bound gradients, while copying a
        large one into a bucket costs memory traffic and a buffer allocation for no fewer bytes on the wire.
        """
        return self.bucket_bytes // 8

    def wire_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``grad_dtype`` is reduced in."""
        if self.reduce_fp16 and grad_dtype == torch.float32:
            return torch.float16
        return grad_dtype


@dataclass(frozen=True)
class SyncPolicy:
    """What is kept identical across ranks besides gradients."""

    #: Copy rank 0's buffers (for example BatchNorm statistics) to every rank at the start of each forward, as
    #: torch DDP does.
    broadcast_buffers: bool = True
    #: Copy rank 0's parameters and buffers to every rank at construction.
    sync_models_at_startup: bool = True
    #: Look for ``requires_grad`` changes at every forward and re-plan the reduction when one is found (costs one
    #: pass over the parameters per forward).
    auto_refresh_trainable: bool = True
    #: Warn when a forward finds that ``requires_grad`` changed.
    warn_on_trainable_params_changed: bool = True

    def __post_init__(self) -> None:
        for name in (
            "broadcast_buffers",
            "sync_models_at_startup",
            "auto_refresh_trainable",
            "warn_on_trainable_params_changed",
        ):
            _check_flag(name, getattr(self, name))


def _check_flag(name: str, value: object) -> None:
    # fairscale's flags are plain truth values; 0 and 1 keep working, anything else is most likely a misplaced
    # positional argument.
    if not isinstance(value, (bool, int)):
        raise TypeError(f"ShardedDataParallel's {name} must be True or False, got {value!r}")
