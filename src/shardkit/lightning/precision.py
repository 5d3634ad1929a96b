"""Lightning precision plugins that know gradients are sharded.

Two things change when each rank holds only part of the gradients:

- clipping by norm must use the norm of the whole model, so it goes through the sharded optimizer
  (``OSS.clip_grad_norm``) or the root sharded module (``FullyShardedDataParallel.clip_grad_norm_``) instead of
  ``torch.nn.utils.clip_grad_norm_`` over one rank's shard;
- with fp16 loss scaling, an inf may show up in one rank's shard only, so the scaler is a
  :class:`~shardkit.optim.ShardedGradScaler` whose skip decision all ranks share.

The strategies translate the plugin Lightning built from ``Trainer(precision=...)`` with
:func:`to_sharded_precision`; users never construct these classes themselves.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.optim import Optimizer

from shardkit.optim.grad_scaler import ShardedGradScaler

#: The ``Trainer(precision=...)`` values the shardkit strategies support.
SUPPORTED_PRECISION = ("32-true", "16-mixed", "bf16-mixed")

NormClipper = Callable[[Optimizer, float], Any]


class _ShardedClipping:
    """Clip by the global norm: the sharded optimizer's own method first, else the strategy's root module."""

    #: Set by the strategy: clips every gradient of the sharded model to a global norm (FSDP's ``clip_grad_norm_``).
    module_norm_clipper: Optional[NormClipper] = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        clip = getattr(inner, "clip_grad_norm", None)
        if callable(clip):
            clip(float(clip_val))
        elif self.module_norm_clipper is not None:
            self.module_norm_clipper(inner, float(clip_val))
        else:
            super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]


class ShardedPrecision(_ShardedClipping, Precision):
    """Full fp32 training (``precision="32-true"``) with clipping by the global norm of sharded gradients."""


class ShardedMixedPrecision(_ShardedClipping, MixedPrecision):
    """Autocast mixed precision (``"16-mixed"``/``"bf16-mixed"``) with a rank-synchronised fp16 loss scaler.

    ``compute_dtype`` is the dtype the sharded model should compute in (what FSDP's mixed precision casts
    parameters to).
    """

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16


def to_sharded_precision(plugin: Optional[Precision], strategy_name: str) -> Optional[Precision]:
    """Translate the plugin Lightning built (or the user passed) into its sharding-aware counterpart.

    Plain ``Precision`` and ``MixedPrecision`` are replaced; our own classes (and subclasses) are kept. Anything
    else (``"16-true"``, ``"64-true"``, transformer-engine, bitsandbytes ...) is rejected with a ValueError.
    """
    if plugin is None or isinstance(plugin, _ShardedClipping):
        return plugin
    if type(plugin) is Precision:
        return ShardedPrecision()
    if type(plugin) is MixedPrecision:
        _check_autocast_supported(plugin.precision, plugin.device, strategy_name)
        scaler = None
        if plugin.precision == "16-mixed":
            old = plugin.scaler
            scaler = ShardedGradScaler(
                device=plugin.device,
                init_scale=old.get_scale() if old is not None and old.is_enabled() else 2.0**16,
                enabled=old.is_enabled() if old is not None else True,
            )
        return ShardedMixedPrecision(plugin.precision, plugin.device, scaler=scaler)  # type: ignore[arg-type]
    precision = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"{strategy_name} supports Trainer(precision=...) in {list(SUPPORTED_PRECISION)}, got {precision!r} "
        f"({type(plugin).__name__}). Use precision='bf16-mixed' or '16-mixed' for reduced precision: the sharded "
        "parameters stay fp32 and are cast for compute."
    )


def _check_autocast_supported(precision: str, device: str, strategy_name: str) -> None:
    """Fail early, with the fix, when this torch build cannot autocast to the requested dtype on ``device``."""
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    problem = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast(device, dtype=dtype):
                enabled = torch.is_autocast_enabled(device)
        if not enabled or any("autocast" in str(w.message).lower() for w in caught):
            problem = "autocast is disabled for it"
    except (RuntimeError, ValueError) as exc:
        problem = str(exc)
    if problem is not None:
        hint = "precision='bf16-mixed'" if precision == "16-mixed" else "precision='32-true'"
        raise ValueError(
            f"{strategy_name}: precision={precision!r} is not supported on device {device!r} by this torch build "
            f"({problem}). Use {hint} instead."
        )
