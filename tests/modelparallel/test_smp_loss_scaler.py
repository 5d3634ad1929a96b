"""The loss scale of smp's FP16 optimizer (issue 34): the rules of smp's ``dynamic_loss_args``, and the config's
refusal of what the FP16 path does not support, without processes."""

from __future__ import annotations

import pytest

from shardkit.modelparallel.precision.loss_scaler import LossScaleOptions, LossScaler

SCALE_ARGS = {"init_scale": 2.0**10, "scale_window": 2, "min_scale": 1, "delayed_shift": 1}


def test_dynamic_scale_halves_on_overflow_grows_after_the_window_and_stops_at_min_scale() -> None:
    scaler = LossScaler(LossScaleOptions.from_smp(None, True, {**SCALE_ARGS, "init_scale": 4.0, "min_scale": 2}))
    seen = []
    for overflow in (False, True, False, False, True, True, True, False):
        scaler.update(overflow)
        seen.append(scaler.scale)
    assert seen == [4.0, 2.0, 2.0, 4.0, 2.0, 2.0, 2.0, 2.0]  # never below min_scale=2
    # delayed_shift=2 tolerates one overflow (hysteresis) before halving; the counter resets when the scale grows
    scaler = LossScaler(LossScaleOptions(dynamic=True, init_scale=8.0, scale_window=2, delayed_shift=2))
    seen = []
    for overflow in (True, True, False, False, True, False):
        scaler.update(overflow)
        seen.append(scaler.scale)
    assert seen == [8.0, 4.0, 4.0, 8.0, 8.0, 8.0]
    static = LossScaler(LossScaleOptions.from_smp(128.0, False, {}))
    static.update(True)
    assert static.scale == 128.0 and not static.dynamic
    assert LossScaleOptions.from_smp(None, True, {}).init_scale == 2.0**32  # smp's default


def test_bad_loss_scaling_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown dynamic_loss_args \['scale_windw'\]"):
        LossScaleOptions.from_smp(None, True, {"scale_windw": 10})
    with pytest.raises(ValueError, match="static_loss_scale=None with dynamic_loss_scale=False"):
        LossScaleOptions.from_smp(None, False, {})
    with pytest.raises(ValueError, match="scale_factor must be a number > 1"):
        LossScaleOptions.from_smp(None, True, {"scale_factor": 1})
