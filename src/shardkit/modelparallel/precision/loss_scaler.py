"""The loss scale of smp's FP16 optimizer: static, or dynamic with smp's ``dynamic_loss_args``.

Under ``"fp16": true`` ``model.backward(loss)`` multiplies the loss by the current scale, the optimizer divides the
gradients by it before updating its FP32 master weights. The dynamic scale follows the rules smp documents for its
``DistributedOptimizer`` (those of Megatron's and apex's FP16 optimizers):

- an overflow (an inf or NaN gradient on any rank) skips the step. The scale is divided by ``scale_factor`` (never
  below ``min_scale``), unless ``delayed_shift`` > 1: then that many overflows are tolerated first (hysteresis),
  the counter being reset at every growth (or after every good step with ``consecutive_hysteresis``);
- after each step, when ``scale_window`` steps have passed since the last overflow (or the start) without one, the
  scale is multiplied by ``scale_factor``.

A static scale never changes and nothing is checked (as smp: an inf gradient is applied). bf16 uses no scale.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

#: smp's ``dynamic_loss_args`` and their defaults.
DYNAMIC_DEFAULTS: dict[str, Any] = {
    "init_scale": 2.0**32,
    "scale_factor": 2.0,
    "scale_window": 1000,
    "min_scale": 1.0,
    "delayed_shift": 1,
    "consecutive_hysteresis": False,
}


@dataclass(frozen=True)
class LossScaleOptions:
    """How the loss is scaled: ``dynamic`` or a fixed ``init_scale``; the dynamic rules' settings.

    Example::

        options = LossScaleOptions.from_smp(static_loss_scale=None, dynamic_loss_scale=True,
                                            dynamic_loss_args={"scale_window": 1000, "delayed_shift": 2})
    """

    #: Whether the scale adapts to overflows (``dynamic_loss_scale=True``).
    dynamic: bool = False
    #: The first scale (the static one when not dynamic).
    init_scale: float = 1.0
    #: Divide the scale by it on an overflow, multiply by it after ``scale_window`` good steps.
    scale_factor: float = 2.0
    #: Good steps since the last overflow before the scale grows.
    scale_window: int = 1000
    #: The scale never goes below it.
    min_scale: float = 1.0
    #: Overflows tolerated before the scale is lowered (1: lower at once).
    delayed_shift: int = 1
    #: Reset the tolerated overflows after every good step (else only when the scale grows).
    consecutive_hysteresis: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"the loss scale must be a finite number > 0, got {self.init_scale!r}")
        if not (math.isfinite(self.scale_factor) and self.scale_factor > 1):
            raise ValueError(f"dynamic_loss_args scale_factor must be a number > 1, got {self.scale_factor!r}")
        if not (math.isfinite(self.min_scale) and self.min_scale > 0):
            raise ValueError(f"dynamic_loss_args min_scale must be a number > 0, got {self.min_scale!r}")
        for name in ("scale_window", "delayed_shift"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dynamic_loss_args {name} must be an int >= 1, got {value!r}")

    @classmethod
    def from_smp(
        cls, static_loss_scale: Optional[float], dynamic_loss_scale: bool, dynamic_loss_args: Mapping[str, Any]
    ) -> LossScaleOptions:
        """smp's ``DistributedOptimizer`` arguments, checked (unknown ``dynamic_loss_args`` are an error)."""
        unknown = sorted(set(dynamic_loss_args) - set(DYNAMIC_DEFAULTS))
        if unknown:
            raise ValueError(
                f"smp.DistributedOptimizer got unknown dynamic_loss_args {unknown}; smp's are "
                f"{', '.join(DYNAMIC_DEFAULTS)}"
            )
        if not isinstance(dynamic_loss_scale, bool):
            raise TypeError(f"dynamic_loss_scale must be True or False, got {dynamic_loss_scale!r}")
        if dynamic_loss_scale:
            values = {**DYNAMIC_DEFAULTS, **dynamic_loss_args}
            values["init_scale"] = float(values["init_scale"])
            values["scale_factor"] = float(values["scale_factor"])
            values["min_scale"] = float(values["min_scale"])
            return cls(dynamic=True, **values)
        if static_loss_scale is None:
            raise ValueError(
                "smp.DistributedOptimizer got static_loss_scale=None with dynamic_loss_scale=False: give a static "
                "scale (1.0 by default) or set dynamic_loss_scale=True"
            )
        if isinstance(static_loss_scale, bool) or not isinstance(static_loss_scale, (int, float)):
            raise TypeError(f"static_loss_scale must be a number, got {static_loss_scale!r}")
        return cls(dynamic=False, init_scale=float(static_loss_scale))


class LossScaler:
    """The current loss scale and the dynamic rules' counters (see the module docstring).

    Example::

        scaler = LossScaler(LossScaleOptions(dynamic=True, init_scale=2.0**16, scale_window=2))
        scaler.update(overflow=True)   # 2**15
        scaler.update(overflow=False)
        scaler.update(overflow=False)  # 2**16: two good steps since the overflow
    """

    def __init__(self, options: LossScaleOptions) -> None:
        self.options = options
        self.scale = options.init_scale
        """The factor ``model.backward`` multiplies the loss by."""
        self.iteration = 0
        """Steps taken or skipped so far."""
        self.last_overflow_iteration = -1
        self.hysteresis = options.delayed_shift
        """Overflows still tolerated before the scale is lowered."""

    @property
    def dynamic(self) -> bool:
        """Whether overflows are checked and the scale adapts."""
        return self.options.dynamic

    def update(self, overflow: bool) -> None:
        """After a step (taken, or skipped for ``overflow``): adapt the scale (dynamic only)."""
        opts = self.options
        if not opts.dynamic:
            return
        if overflow:
            if opts.delayed_shift == 1 or self.hysteresis == 1:
                self.scale = max(self.scale / opts.scale_factor, opts.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if opts.consecutive_hysteresis:
                self.hysteresis = opts.delayed_shift
            if (self.iteration - self.last_overflow_iteration) % opts.scale_window == 0:
                if not opts.consecutive_hysteresis:
                    self.hysteresis = opts.delayed_shift
                self.scale *= opts.scale_factor
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        """The scale and counters (plain Python values), as saved in the optimizer's state dict."""
        return {
            "loss_scale": self.scale,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "hysteresis": self.hysteresis,
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Resume the scale and counters of :meth:`state_dict` (the options stay this scaler's)."""
        self.scale = float(saved["loss_scale"])
        self.iteration = int(saved["iteration"])
        self.last_overflow_iteration = int(saved["last_overflow_iteration"])
        self.hysteresis = int(saved["hysteresis"])
